// Emits pickle opcodes by hand, for tests that need pickles PyTorch would never
// write (hostile ones included).
#ifndef WEIGHTSTORE_TESTS_UTIL_PICKLE_BUILDER_H_
#define WEIGHTSTORE_TESTS_UTIL_PICKLE_BUILDER_H_

#include <cstdint>
#include <string>

namespace weightstore::testing {

class PickleBuilder {
 public:
  PickleBuilder& Proto(int v) { return Op('\x80').Byte(v); }
  PickleBuilder& Global(const std::string& module, const std::string& name) {
    return Op('c').Raw(module + "\n" + name + "\n");
  }
  PickleBuilder& Str(const std::string& s) { return Op('X').U32(s.size()).Raw(s); }
  PickleBuilder& Int(uint32_t v) { return Op('J').U32(v); }
  PickleBuilder& Mark() { return Op('('); }
  PickleBuilder& Tuple() { return Op('t'); }
  PickleBuilder& EmptyTuple() { return Op(')'); }
  PickleBuilder& EmptyDict() { return Op('}'); }
  PickleBuilder& EmptyList() { return Op(']'); }
  PickleBuilder& None() { return Op('N'); }
  PickleBuilder& False() { return Op('\x89'); }
  PickleBuilder& SetItem() { return Op('s'); }
  PickleBuilder& SetItems() { return Op('u'); }
  PickleBuilder& Append() { return Op('a'); }
  PickleBuilder& Reduce() { return Op('R'); }
  PickleBuilder& BinPersId() { return Op('Q'); }
  PickleBuilder& Put(uint8_t i) { return Op('q').Byte(i); }
  PickleBuilder& Get(uint8_t i) { return Op('h').Byte(i); }
  PickleBuilder& Stop() { return Op('.'); }

  // Pushes ('storage', torch.<cls>, key, 'cpu', numel) as a persistent id.
  PickleBuilder& StorageRef(const std::string& cls, const std::string& key, uint32_t numel) {
    return Mark().Str("storage").Global("torch", cls).Str(key).Str("cpu").Int(numel).Tuple().BinPersId();
  }
  // Pushes _rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict()).
  PickleBuilder& Tensor(const std::string& cls, const std::string& key, uint32_t numel, uint32_t offset,
                        std::initializer_list<uint32_t> size, std::initializer_list<uint32_t> stride) {
    Global("torch._utils", "_rebuild_tensor_v2").Mark().StorageRef(cls, key, numel).Int(offset);
    Mark();
    for (uint32_t s : size) Int(s);
    Tuple().Mark();
    for (uint32_t s : stride) Int(s);
    return Tuple().False().Global("collections", "OrderedDict").EmptyTuple().Reduce().Tuple().Reduce();
  }

  PickleBuilder& Raw(const std::string& s) {
    out_ += s;
    return *this;
  }
  PickleBuilder& Byte(int v) {
    out_.push_back(static_cast<char>(v));
    return *this;
  }
  PickleBuilder& U32(uint32_t v) {
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
    return *this;
  }
  const std::string& str() const { return out_; }

 private:
  PickleBuilder& Op(char c) {
    out_.push_back(c);
    return *this;
  }
  std::string out_;
};

}  // namespace weightstore::testing

#endif  // WEIGHTSTORE_TESTS_UTIL_PICKLE_BUILDER_H_
