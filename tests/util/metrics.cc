#include "tests/util/metrics.h"

#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "tests/util/test_env.h"

namespace weightstore::testing {
namespace {

// Whether the label list `labels` (`a="x",b="y"`) holds `label` whole.
bool HasLabel(absl::string_view labels, absl::string_view label) {
  for (size_t at = labels.find(label); at != absl::string_view::npos; at = labels.find(label, at + 1)) {
    const size_t end = at + label.size();
    if ((at == 0 || labels[at - 1] == ',') && (end == labels.size() || labels[end] == ',')) return true;
  }
  return false;
}

}  // namespace

double MetricValue(int port, absl::string_view name, std::initializer_list<absl::string_view> labels) {
  const std::string text = HttpGet(port, "/metrics");
  double sum = 0;
  bool matched = false;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    // A sample: name, optional {labels}, a space, the value.
    if (line.empty() || line[0] == '#') continue;
    const size_t name_end = line.find_first_of("{ ");
    const size_t value_at = line.rfind(' ');
    if (name_end == absl::string_view::npos || value_at < name_end || line.substr(0, name_end) != name) continue;
    absl::string_view label_list;
    if (line[name_end] == '{') {
      const size_t close = line.rfind('}', value_at);
      if (close == absl::string_view::npos || close < name_end) continue;
      label_list = line.substr(name_end + 1, close - name_end - 1);
    }
    bool wanted = true;
    for (absl::string_view label : labels) wanted = wanted && HasLabel(label_list, label);
    double value = 0;
    if (!wanted || !absl::SimpleAtod(line.substr(value_at + 1), &value)) continue;
    sum += value;
    matched = true;
  }
  return matched ? sum : -1;
}

}  // namespace weightstore::testing
