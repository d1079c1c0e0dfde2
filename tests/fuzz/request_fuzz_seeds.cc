// Writes request_fuzz's seed corpus into a folder: ordinary requests (every
// selection feature) and the requests of issue 11's attacks, each as the call
// byte request_fuzz reads first, then the serialized request.
#include <cstdio>
#include <fstream>
#include <string>

#include "weightstore/v1/shm.pb.h"
#include "weightstore/v1/weight_store.pb.h"

namespace {

namespace pb = ::weightstore::v1;

int written = 0;

void Write(const std::string& dir, char call, const google::protobuf::Message& request) {
  std::ofstream out(dir + "/seed-" + std::to_string(written++), std::ios::binary);
  out.put(call);
  out << request.SerializeAsString();
}

pb::Selection Ordinary() {
  pb::Selection s;
  s.add_include(R"(^fc\d\.)");
  s.add_exclude(R"(\.bias$)");
  pb::RenameRule* r = s.add_renames();
  r->set_pattern(R"(^(\w+)\.)");
  r->set_replacement("layer.${1}.");
  s.set_dtype("F16");
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: request_fuzz_seeds FOLDER\n");
    return 2;
  }
  const std::string dir = argv[1];
  for (const char* name : {"tiny-mlp", "tiny-mlp-burn", "tiny-mlp-torch"}) {
    pb::ListTensorsRequest list;
    list.set_name(name);
    list.set_with_checksums(true);
    Write(dir, 0, list);
    *list.mutable_selection() = Ordinary();
    Write(dir, 0, list);
    pb::FetchTensorsRequest fetch;
    fetch.set_name(name);
    Write(dir, 1, fetch);
    *fetch.mutable_selection() = Ordinary();
    fetch.set_chunk_bytes(4096);
    Write(dir, 1, fetch);
    pb::GetCheckpointRequest get;
    get.set_name(name);
    Write(dir, 2, get);
    pb::ShmRequest shm;
    shm.mutable_map_tensors()->set_name(name);
    Write(dir, 3, shm);
    *shm.mutable_map_tensors()->mutable_selection() = Ordinary();
    Write(dir, 4, shm.map_tensors());
  }
  {  // issue 27: shards whose scales follow their weights, experts by rank, a narrowing cast
    pb::FetchTensorsRequest fetch;
    fetch.set_name("tiny-mlp");
    pb::Selection* s = fetch.mutable_selection();
    s->set_dtype("F8_E4M3");
    pb::Shard* shard = s->mutable_shard();
    shard->set_rank(1);
    shard->set_world_size(2);
    pb::ShardRule* rule = shard->add_rules();
    rule->set_pattern(R"(\.weight$)");
    rule->set_dim(0);
    pb::ScaleRule* scale = shard->add_scales();
    scale->set_pattern(R"(\.bias$)");
    scale->set_weight(".weight");
    scale->add_block(2);
    shard->add_experts(R"(fc(\d+)\.)");
    Write(dir, 1, fetch);
    shard->set_no_scale_detection(true);
    s->set_dtype("F8_E5M2FNUZ");
    Write(dir, 1, fetch);
  }
  {  // a PyTorch checkpoint: top-level key, contiguous indices, a target with an adapter
    pb::ListTensorsRequest list;
    list.set_name("tiny-mlp-torch");
    pb::Selection* s = list.mutable_selection();
    s->set_top_level_key("model_state_dict");
    s->set_contiguous_indices(true);
    s->set_adapter("pytorch-to-burn");
    s->set_allow_partial(true);
    for (const char* path : {"0.weight", "0.bias", "1.gamma", "2.weight", "missing.weight"}) {
      pb::TargetParameter* p = s->mutable_target()->add_parameters();
      p->set_path(path);
      p->add_shape(16);
      p->add_shape(32);
      p->set_module(path[0] == '1' ? "LayerNorm" : "Linear");
    }
    Write(dir, 0, list);
    pb::FetchTensorsRequest fetch;
    fetch.set_name("tiny-mlp-torch");
    *fetch.mutable_selection() = list.selection();
    fetch.set_start_index(1);
    fetch.set_end_index(3);
    Write(dir, 1, fetch);
  }
  {  // issue 28: updates since a version, asking for element patches, on every transport
    pb::ListTensorsRequest list;
    list.set_name("tiny-mlp");
    list.set_since_version("0123456789abcdef0123456789abcdef");
    list.set_patches(true);
    Write(dir, 0, list);
    pb::FetchTensorsRequest fetch;
    fetch.set_name("tiny-mlp");
    fetch.set_since_version(std::string(64, 'f'));
    fetch.set_patches(true);
    Write(dir, 1, fetch);
    *fetch.mutable_selection() = Ordinary();
    Write(dir, 1, fetch);
    pb::MapTensorsRequest map;
    map.set_name("tiny-mlp");
    map.set_since_version("0123456789abcdef");
    map.set_patches(true);
    Write(dir, 4, map);
    map.set_table_only(true);
    Write(dir, 4, map);
  }
  // Issue 11's attacks.
  for (const std::string& name : {std::string("\xff\xfe"), std::string("a\r\nb"), std::string(600, 'n')}) {
    pb::GetCheckpointRequest get;
    get.set_name(name);
    Write(dir, 2, get);
  }
  {
    pb::ListTensorsRequest list;
    list.set_name("tiny-mlp");
    for (int i = 0; i < 10; ++i) list.mutable_selection()->add_renames()->set_replacement(std::string(1000, 'x'));
    Write(dir, 0, list);
  }
  {
    pb::ListTensorsRequest list;
    list.set_name("tiny-mlp");
    for (int i = 0; i < 300; ++i) list.mutable_selection()->add_include("[^a]{900}");
    Write(dir, 0, list);
  }
  {
    pb::ListTensorsRequest list;
    list.set_name("tiny-mlp");
    pb::TargetParameter* p = list.mutable_selection()->mutable_target()->add_parameters();
    p->set_path(std::string(8000, '.'));
    list.mutable_selection()->set_allow_partial(true);
    Write(dir, 0, list);
  }
  {
    pb::FetchTensorsRequest fetch;
    fetch.set_name("tiny-mlp");
    fetch.set_start_index(~uint64_t{0});
    fetch.set_end_index(1);
    fetch.set_version(std::string(100, 'v'));
    Write(dir, 1, fetch);
  }
  std::printf("%d seeds in %s\n", written, dir.c_str());
  return 0;
}
