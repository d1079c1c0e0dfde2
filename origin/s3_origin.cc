#include "origin/s3_origin.h"

#include <curl/curl.h>
#include <expat.h>
#include <openssl/evp.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/catalog/registry.h"
#include "core/status_macros.h"
#include "nlohmann/json.hpp"

namespace weightstore::origin {
namespace {

// The extensions a checkpoint's main file may have, in the order Find tries
// them (the registry's formats; a sharded index first).
constexpr std::array<absl::string_view, 5> kExtensions = {".safetensors.index.json", ".safetensors", ".bpk", ".pt",
                                                          ".pth"};
constexpr absl::string_view kIndexExtension = ".safetensors.index.json";

constexpr size_t kMaxListPageBytes = size_t{16} << 20;
constexpr uint64_t kMaxIndexBytes = uint64_t{64} << 20;
constexpr size_t kMaxErrorBodyBytes = size_t{64} << 10;
constexpr size_t kMaxXmlText = 4096;
constexpr int kMaxXmlDepth = 32;
constexpr size_t kMaxKeyBytes = 1024;  // S3's own limit on a key
constexpr size_t kMaxHeaderValue = 1024;
// The longest object version id taken from a HEAD (S3's are 32 bytes); a
// longer one is not pinned, so reads go by ETag alone.
constexpr size_t kMaxObjectVersion = 256;
constexpr size_t kMaxShownMessage = 200;

// A relative path the node may create (core/catalog/registry.h): names and prefixes
// follow the same rule.
bool IsCleanRelativePath(absl::string_view path) { return IsPlaceableName(path, kMaxKeyBytes); }

bool IsBucketName(absl::string_view bucket) {
  if (bucket.size() < 3 || bucket.size() > 63) return false;
  for (char c : bucket) {
    if (!absl::ascii_islower(c) && !absl::ascii_isdigit(c) && c != '.' && c != '-') return false;
  }
  return absl::ascii_isalnum(bucket.front()) && absl::ascii_isalnum(bucket.back()) && !absl::StrContains(bucket, "..");
}

// Printable ASCII only: what may go into a header line.
bool IsHeaderSafe(absl::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c >= 0x20 && c < 0x7f; });
}

// Percent-encodes all but RFC 3986's unreserved characters (and '/' when
// `keep_slash`), in upper-case hex: the form SigV4's canonical request uses,
// so the URL can be signed as it is sent.
std::string UriEncode(absl::string_view s, bool keep_slash) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size());
  for (unsigned char c : s) {
    if (absl::ascii_isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' || (keep_slash && c == '/')) {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

// Shown text from the server: bounded and escaped.
std::string Shown(absl::string_view s) {
  if (s.size() <= kMaxShownMessage) return absl::CHexEscape(s);
  return absl::StrCat(absl::CHexEscape(s.substr(0, kMaxShownMessage)), "...");
}

// An ETag compared without its quotes or weak marker.
absl::string_view BareEtag(absl::string_view etag) {
  absl::ConsumePrefix(&etag, "W/");
  if (etag.size() >= 2 && etag.front() == '"' && etag.back() == '"') etag = etag.substr(1, etag.size() - 2);
  return etag;
}

// The MD5 an ETag states for an object uploaded in one part ("<32 hex>"),
// or "" (a multipart upload's ETag is no digest of the bytes).
std::string EtagMd5(absl::string_view etag) {
  const absl::string_view bare = BareEtag(etag);
  if (bare.size() != 32 || !std::all_of(bare.begin(), bare.end(), absl::ascii_isxdigit)) return "";
  return absl::AsciiStrToLower(bare);
}

// Parses an XML document with expat and calls `on_end(path, text)` at the end
// of each element: path is the element names from the root, '/'-separated;
// text is its character data (after its last child), cut at kMaxXmlText.
// Refuses DTDs and nesting deeper than kMaxXmlDepth. Errors name `what`.
class XmlReader {
 public:
  using OnEnd = std::function<absl::Status(const std::string& path, const std::string& text)>;

  static absl::Status Parse(absl::string_view xml, const std::string& what, const OnEnd& on_end) {
    XmlReader reader(what, on_end);
    XML_Parser parser = XML_ParserCreate(nullptr);
    if (parser == nullptr) return absl::ResourceExhaustedError("cannot create an XML parser");
    reader.parser_ = parser;
    XML_SetUserData(parser, &reader);
    XML_SetElementHandler(parser, &XmlReader::Start, &XmlReader::End);
    XML_SetCharacterDataHandler(parser, &XmlReader::Text);
    XML_SetStartDoctypeDeclHandler(parser, &XmlReader::Doctype);
    const XML_Status parsed = XML_Parse(parser, xml.data(), static_cast<int>(xml.size()), /*isFinal=*/XML_TRUE);
    std::string error = parsed == XML_STATUS_OK ? "" : XML_ErrorString(XML_GetErrorCode(parser));
    const uint64_t line = XML_GetCurrentLineNumber(parser);
    XML_ParserFree(parser);
    if (!reader.status_.ok()) return reader.status_;
    if (parsed != XML_STATUS_OK)
      return absl::DataLossError(absl::StrCat(what, ": invalid XML (", error, " at line ", line, ")"));
    return absl::OkStatus();
  }

 private:
  XmlReader(const std::string& what, const OnEnd& on_end) : what_(what), on_end_(on_end) {}

  void Fail(absl::Status status) {
    if (status_.ok()) status_ = std::move(status);
    XML_StopParser(parser_, XML_FALSE);
  }

  static void Start(void* user, const XML_Char* name, const XML_Char** /*attributes*/) {
    auto* self = static_cast<XmlReader*>(user);
    if (!self->status_.ok()) return;
    if (self->starts_.size() >= kMaxXmlDepth) {
      self->Fail(absl::DataLossError(absl::StrCat(self->what_, ": XML nested deeper than ", kMaxXmlDepth)));
      return;
    }
    self->starts_.push_back(self->path_.size());
    if (!self->path_.empty()) self->path_.push_back('/');
    self->path_.append(name);
    self->text_.clear();
  }

  static void End(void* user, const XML_Char* /*name*/) {
    auto* self = static_cast<XmlReader*>(user);
    if (!self->status_.ok() || self->starts_.empty()) return;
    absl::Status status = self->on_end_(self->path_, self->text_);
    if (!status.ok()) {
      self->Fail(std::move(status));
      return;
    }
    self->path_.resize(self->starts_.back());
    self->starts_.pop_back();
    self->text_.clear();
  }

  static void Text(void* user, const XML_Char* s, int len) {
    auto* self = static_cast<XmlReader*>(user);
    const size_t room = kMaxXmlText - std::min(kMaxXmlText, self->text_.size());
    self->text_.append(s, std::min(room, static_cast<size_t>(len)));
  }

  static void Doctype(void* user, const XML_Char*, const XML_Char*, const XML_Char*, int) {
    auto* self = static_cast<XmlReader*>(user);
    self->Fail(absl::DataLossError(absl::StrCat(self->what_, ": XML with a DTD")));
  }

  const std::string& what_;
  const OnEnd& on_end_;
  XML_Parser parser_ = nullptr;
  std::string path_;
  std::vector<size_t> starts_;  // path_'s size before each open element
  std::string text_;
  absl::Status status_;
};

// Whether an S3 error code means the credentials themselves were refused.
bool IsCredentialError(absl::string_view code) {
  return code == "InvalidAccessKeyId" || code == "SignatureDoesNotMatch" || code == "ExpiredToken" ||
         code == "InvalidToken" || code == "TokenRefreshRequired";
}

// The Code of an S3 error body ("NoSuchVersion"), or "".
std::string ErrorCode(absl::string_view body) {
  std::string code;
  XmlReader::Parse(body, "an error reply", [&](const std::string& path, const std::string& text) {
    if (path == "Error/Code") code = text;
    return absl::OkStatus();
  }).IgnoreError();
  return code;
}

// Whether a refused read of an object version says the store will not read
// versions for these credentials (no s3:GetObjectVersion: 403 AccessDenied)
// or at all (a store or proxy that sends version ids but takes no
// versionId: 400 InvalidArgument, 405, 501 NotImplemented), rather than
// something a read by ETag would meet too.
bool RefusesVersionReads(long http, absl::string_view code) {
  if (http == 403) return code == "AccessDenied";
  if (http == 400) return code == "InvalidArgument";
  return http == 405 || http == 501 || code == "NotImplemented";
}

// Maps a non-2xx reply to a status naming `what` (an s3:// url), with the S3
// error body's Code and Message when it has them.
absl::Status HttpError(long http, absl::string_view body, const std::string& what) {
  std::string code, message;
  // Best effort: a body that is not S3's error XML leaves both empty.
  XmlReader::Parse(body, what, [&](const std::string& path, const std::string& text) {
    if (path == "Error/Code") code = text;
    if (path == "Error/Message") message = text;
    return absl::OkStatus();
  }).IgnoreError();
  std::string detail = absl::StrCat("HTTP ", http);
  if (!code.empty()) absl::StrAppend(&detail, " ", Shown(code));
  if (!message.empty()) absl::StrAppend(&detail, ": ", Shown(message));
  if (http == 404) return absl::NotFoundError(absl::StrCat(what, ": not found (", detail, ")"));
  if (IsCredentialError(code)) {
    return absl::UnauthenticatedError(absl::StrCat(what, ": credentials refused (", detail, ")"));
  }
  if (http == 403) return absl::PermissionDeniedError(absl::StrCat(what, ": access denied (", detail, ")"));
  if (http == 412) return absl::AbortedError(absl::StrCat(what, " changed at the origin (", detail, ")"));
  if (http >= 500 || http == 429) {
    return absl::UnavailableError(absl::StrCat(what, ": the origin is unavailable (", detail, ")"));
  }
  return absl::UnknownError(absl::StrCat(what, ": unexpected reply (", detail, ")"));
}

// Whether a curl error means the server could not be reached or stopped
// answering (retrying may help).
bool IsTransportError(CURLcode rc) {
  switch (rc) {
    case CURLE_COULDNT_RESOLVE_PROXY:
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_CONNECT:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_PEER_FAILED_VERIFICATION:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
    case CURLE_PARTIAL_FILE:
    case CURLE_WEIRD_SERVER_REPLY:
    case CURLE_AGAIN:
      return true;
    default:
      return false;
  }
}

std::string Dirname(absl::string_view path) {
  const size_t slash = path.rfind('/');
  return slash == absl::string_view::npos ? "" : std::string(path.substr(0, slash));
}

std::string JoinPath(absl::string_view a, absl::string_view b) {
  if (a.empty()) return std::string(b);
  if (b.empty()) return std::string(a);
  return absl::StrCat(a, "/", b);
}

}  // namespace

// One response as it arrives: the status line and the headers we need, and
// the body handed to on_start / on_body (2xx) or kept, bounded (errors).
struct S3Origin::Reply {
  // Called once before the first body byte of a 2xx reply (or after an empty
  // one); a non-OK status stops the transfer.
  std::function<absl::Status(const Reply&)> on_start;
  std::function<absl::Status(absl::string_view)> on_body;

  long http = 0;
  std::string etag;
  std::string content_range;
  std::string encryption;           // x-amz-server-side-encryption
  std::string customer_encryption;  // x-amz-server-side-encryption-customer-algorithm
  std::string checksum_crc32c;      // x-amz-checksum-crc32c (base64)
  std::string checksum_type;        // x-amz-checksum-type
  std::string version_id;           // x-amz-version-id
  std::string error_body;
  bool started = false;
  absl::Status stopped;  // why a callback stopped the transfer
  CURLcode curl_code = CURLE_OK;

  bool ok_status() const { return http >= 200 && http < 300; }

  absl::Status Start() {
    started = true;
    if (ok_status() && on_start) return on_start(*this);
    return absl::OkStatus();
  }

  static size_t OnHeader(char* data, size_t size, size_t n, void* user) {
    auto* self = static_cast<Reply*>(user);
    absl::string_view line(data, size * n);
    if (absl::StartsWith(line, "HTTP/")) {  // a new response (after a 100 Continue, say)
      self->http = 0;
      self->etag.clear();
      self->content_range.clear();
      self->encryption.clear();
      self->customer_encryption.clear();
      self->checksum_crc32c.clear();
      self->checksum_type.clear();
      self->version_id.clear();
      std::vector<absl::string_view> parts = absl::StrSplit(line, absl::MaxSplits(' ', 2));
      int http = 0;
      if (parts.size() >= 2 && absl::SimpleAtoi(parts[1], &http)) self->http = http;
      return size * n;
    }
    const size_t colon = line.find(':');
    if (colon == absl::string_view::npos) return size * n;
    absl::string_view name = absl::StripAsciiWhitespace(line.substr(0, colon));
    absl::string_view value = absl::StripAsciiWhitespace(line.substr(colon + 1));
    value = value.substr(0, kMaxHeaderValue);
    if (absl::EqualsIgnoreCase(name, "etag")) self->etag = std::string(value);
    if (absl::EqualsIgnoreCase(name, "content-range")) self->content_range = std::string(value);
    if (absl::EqualsIgnoreCase(name, "x-amz-server-side-encryption")) self->encryption = std::string(value);
    if (absl::EqualsIgnoreCase(name, "x-amz-server-side-encryption-customer-algorithm")) {
      self->customer_encryption = std::string(value);
    }
    if (absl::EqualsIgnoreCase(name, "x-amz-checksum-crc32c")) self->checksum_crc32c = std::string(value);
    if (absl::EqualsIgnoreCase(name, "x-amz-checksum-type")) self->checksum_type = std::string(value);
    if (absl::EqualsIgnoreCase(name, "x-amz-version-id")) self->version_id = std::string(value);
    return size * n;
  }

  static size_t OnBody(char* data, size_t size, size_t n, void* user) {
    auto* self = static_cast<Reply*>(user);
    absl::string_view bytes(data, size * n);
    if (!self->started) {
      self->stopped = self->Start();
      if (!self->stopped.ok()) return 0;
    }
    if (self->ok_status()) {
      if (self->on_body) self->stopped = self->on_body(bytes);
      return self->stopped.ok() ? bytes.size() : 0;
    }
    const size_t room = kMaxErrorBodyBytes - std::min(kMaxErrorBodyBytes, self->error_body.size());
    self->error_body.append(bytes.data(), std::min(room, bytes.size()));
    return bytes.size();
  }
};

class S3Origin::Handle {
 public:
  Handle() : curl_(curl_easy_init()) { error_[0] = '\0'; }
  ~Handle() {
    if (curl_ != nullptr) curl_easy_cleanup(curl_);
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  CURL* curl() const { return curl_; }
  char* error_buffer() { return error_; }

 private:
  CURL* curl_;
  char error_[CURL_ERROR_SIZE];
};

void FillFromEnvironment(S3Config* config) {
  auto env = [](const char* name) -> std::string {
    const char* value = std::getenv(name);
    return value == nullptr ? "" : value;
  };
  if (config->access_key_id.empty() && config->secret_access_key.empty()) {
    config->access_key_id = env("AWS_ACCESS_KEY_ID");
    config->secret_access_key = env("AWS_SECRET_ACCESS_KEY");
    if (config->session_token.empty()) config->session_token = env("AWS_SESSION_TOKEN");
  }
  if (config->region.empty() || config->region == S3Config().region) {
    std::string region = env("AWS_REGION");
    if (region.empty()) region = env("AWS_DEFAULT_REGION");
    if (!region.empty()) config->region = region;
  }
  if (config->endpoint.empty()) {
    config->endpoint = env("AWS_ENDPOINT_URL_S3");
    if (config->endpoint.empty()) config->endpoint = env("AWS_ENDPOINT_URL");
  }
}

absl::StatusOr<std::unique_ptr<Origin>> S3Origin::Create(const std::string& url, S3Config config) {
  auto bad_url = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("origin url '", Shown(url), "': ", why));
  };
  absl::string_view rest = url;
  if (!absl::ConsumePrefix(&rest, "s3://")) return bad_url("expected s3://bucket or s3://bucket/prefix/");
  const size_t slash = rest.find('/');
  const absl::string_view bucket = rest.substr(0, slash);
  absl::string_view prefix = slash == absl::string_view::npos ? "" : rest.substr(slash + 1);
  absl::ConsumeSuffix(&prefix, "/");
  if (!IsBucketName(bucket)) return bad_url("a bucket name is 3-63 characters of [a-z0-9.-]");
  if (!prefix.empty() && !IsCleanRelativePath(prefix)) {
    return bad_url("a prefix is '/'-separated names of letters, digits, '-', '_' and '.' (not \".\" or \"..\")");
  }

  auto bad_config = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("S3 origin ", Shown(url), ": ", why));
  };
  if (config.region.empty() || !std::all_of(config.region.begin(), config.region.end(), [](char c) {
        return absl::ascii_islower(c) || absl::ascii_isdigit(c) || c == '-';
      })) {
    return bad_config("region must be lower-case letters, digits and '-'");
  }
  if (!config.endpoint.empty()) {
    while (absl::EndsWith(config.endpoint, "/")) config.endpoint.pop_back();
    const absl::string_view endpoint = config.endpoint;
    if ((!absl::StartsWith(endpoint, "http://") && !absl::StartsWith(endpoint, "https://")) ||
        !IsHeaderSafe(endpoint) || absl::StrContains(endpoint, "@") || absl::StrContains(endpoint, "?") ||
        absl::StrContains(endpoint, "#") || absl::StrContains(endpoint, " ")) {
      return bad_config("endpoint must be an http:// or https:// URL without credentials, query or fragment");
    }
  }
  if (config.access_key_id.empty() != config.secret_access_key.empty()) {
    return bad_config("an access key id needs a secret access key, and a secret an access key id");
  }
  if (config.access_key_id.empty() && !config.session_token.empty()) {
    return bad_config("a session token needs an access key id and a secret access key");
  }
  if (!IsHeaderSafe(config.access_key_id) || !IsHeaderSafe(config.secret_access_key) ||
      !IsHeaderSafe(config.session_token) || absl::StrContains(config.access_key_id, ":")) {
    return bad_config("credentials must be printable ASCII (and an access key id has no ':')");
  }
  if (config.parallel_reads < 1) return bad_config("parallel_reads must be at least 1");
  if (config.connect_timeout_ms < 1) return bad_config("connect_timeout_ms must be at least 1");
  if (config.low_speed_seconds < 1) return bad_config("low_speed_seconds must be at least 1");
  if (config.max_list_objects < 1) return bad_config("max_list_objects must be at least 1");

  static std::once_flag curl_once;
  static CURLcode init = CURLE_OK;
  std::call_once(curl_once, [] { init = curl_global_init(CURL_GLOBAL_DEFAULT); });
  if (init != CURLE_OK) return absl::InternalError(absl::StrCat("curl_global_init: ", curl_easy_strerror(init)));

  return std::unique_ptr<Origin>(new S3Origin(std::string(bucket), std::string(prefix), std::move(config)));
}

S3Origin::S3Origin(std::string bucket, std::string prefix, S3Config config)
    : bucket_(std::move(bucket)), prefix_(std::move(prefix)), config_(std::move(config)) {}

S3Origin::~S3Origin() = default;

std::string S3Origin::Describe() const {
  std::string out = absl::StrCat("s3://", bucket_);
  if (!prefix_.empty()) absl::StrAppend(&out, "/", prefix_);
  if (!config_.endpoint.empty()) absl::StrAppend(&out, " at ", config_.endpoint);
  return out;
}

std::string S3Origin::ObjectUrl(const std::string& key) const { return absl::StrCat("s3://", bucket_, "/", key); }

std::string S3Origin::HttpUrl(const std::string& key) const {
  const std::string path = UriEncode(key, /*keep_slash=*/true);
  if (!config_.endpoint.empty()) {
    return key.empty() ? absl::StrCat(config_.endpoint, "/", bucket_)
                       : absl::StrCat(config_.endpoint, "/", bucket_, "/", path);
  }
  // Virtual-hosted style, except for dotted names (the wildcard certificate
  // covers one label only).
  if (!absl::StrContains(bucket_, ".")) {
    return absl::StrCat("https://", bucket_, ".s3.", config_.region, ".amazonaws.com/", path);
  }
  return key.empty() ? absl::StrCat("https://s3.", config_.region, ".amazonaws.com/", bucket_)
                     : absl::StrCat("https://s3.", config_.region, ".amazonaws.com/", bucket_, "/", path);
}

std::unique_ptr<S3Origin::Handle> S3Origin::AcquireHandle() {
  {
    absl::MutexLock lock(&mu_);
    if (!idle_.empty()) {
      std::unique_ptr<Handle> handle = std::move(idle_.back());
      idle_.pop_back();
      return handle;
    }
  }
  return std::make_unique<Handle>();
}

void S3Origin::ReleaseHandle(std::unique_ptr<Handle> handle) {
  // Reset keeps the handle's live connections for the next request.
  curl_easy_reset(handle->curl());
  absl::MutexLock lock(&mu_);
  if (idle_.size() < static_cast<size_t>(config_.parallel_reads) + 2) idle_.push_back(std::move(handle));
}

absl::Status S3Origin::Perform(const std::string& url, const std::vector<std::string>& headers, const std::string& what,
                               Reply* reply, bool head) {
  std::unique_ptr<Handle> handle = AcquireHandle();
  CURL* curl = handle->curl();
  if (curl == nullptr) return absl::ResourceExhaustedError(absl::StrCat(what, ": cannot create a curl handle"));

  const bool signed_request = !config_.access_key_id.empty();
  curl_slist* list = nullptr;
  std::vector<std::string> all = headers;
  if (signed_request) {
    // Signed as the payload hash (libcurl 7.88 takes this header's value into
    // the canonical request); S3 and s3rver require it with SigV4.
    all.push_back("x-amz-content-sha256: UNSIGNED-PAYLOAD");
    if (!config_.session_token.empty()) all.push_back(absl::StrCat("x-amz-security-token: ", config_.session_token));
  }
  for (const std::string& header : all) {
    curl_slist* next = curl_slist_append(list, header.c_str());
    if (next == nullptr) {
      curl_slist_free_all(list);
      return absl::ResourceExhaustedError(absl::StrCat(what, ": out of memory for headers"));
    }
    list = next;
  }
  std::unique_ptr<curl_slist, decltype(&curl_slist_free_all)> list_owner(list, &curl_slist_free_all);

  handle->error_buffer()[0] = '\0';
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_HTTPGET, 1L);
  if (head) curl_easy_setopt(curl, CURLOPT_NOBODY, 1L);
  curl_easy_setopt(curl, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(curl, CURLOPT_FOLLOWLOCATION, 0L);
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl, CURLOPT_TCP_KEEPALIVE, 1L);
  curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(config_.connect_timeout_ms));
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_LIMIT, static_cast<long>(config_.low_speed_bytes_per_second));
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_TIME, static_cast<long>(config_.low_speed_seconds));
  curl_easy_setopt(curl, CURLOPT_BUFFERSIZE, 256L * 1024);
  curl_easy_setopt(curl, CURLOPT_USERAGENT, "weightstore");
  curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, handle->error_buffer());
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, list);
  curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, &Reply::OnHeader);
  curl_easy_setopt(curl, CURLOPT_HEADERDATA, reply);
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, &Reply::OnBody);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, reply);
  std::string sigv4;
  if (signed_request) {
    sigv4 = absl::StrCat("aws:amz:", config_.region, ":s3");
    curl_easy_setopt(curl, CURLOPT_AWS_SIGV4, sigv4.c_str());
    curl_easy_setopt(curl, CURLOPT_USERNAME, config_.access_key_id.c_str());
    curl_easy_setopt(curl, CURLOPT_PASSWORD, config_.secret_access_key.c_str());
  }

  // Cancel() ends a transfer through the progress callback, which libcurl
  // calls about once a second even while nothing arrives.
  curl_easy_setopt(curl, CURLOPT_NOPROGRESS, 0L);
  curl_easy_setopt(curl, CURLOPT_XFERINFODATA, &cancelled_);
  curl_easy_setopt(
      curl, CURLOPT_XFERINFOFUNCTION, +[](void* cancelled, curl_off_t, curl_off_t, curl_off_t, curl_off_t) -> int {
        return static_cast<const std::atomic<bool>*>(cancelled)->load() ? 1 : 0;
      });
  if (cancelled_.load()) {
    ReleaseHandle(std::move(handle));
    return absl::CancelledError(absl::StrCat(what, ": the daemon is stopping"));
  }
  reply->curl_code = curl_easy_perform(curl);
  std::string curl_error = handle->error_buffer()[0] != '\0' ? std::string(handle->error_buffer())
                                                             : std::string(curl_easy_strerror(reply->curl_code));
  ReleaseHandle(std::move(handle));

  if (!reply->stopped.ok()) return reply->stopped;
  if (reply->curl_code == CURLE_ABORTED_BY_CALLBACK) {
    return absl::CancelledError(absl::StrCat(what, ": the daemon is stopping"));
  }
  if (reply->curl_code != CURLE_OK) {
    if (IsTransportError(reply->curl_code)) {
      return absl::UnavailableError(absl::StrCat("cannot reach ", what, " (", Describe(), "): ", curl_error));
    }
    return absl::UnknownError(absl::StrCat(what, " (", Describe(), "): ", curl_error));
  }
  if (!reply->ok_status()) return HttpError(reply->http, reply->error_body, what);
  if (!reply->started) WEIGHTSTORE_RETURN_IF_ERROR(reply->Start());
  return absl::OkStatus();
}

absl::Status S3Origin::List(const std::string& folder_prefix, std::vector<OriginFile>* objects) {
  const std::string what = absl::StrCat("listing s3://", bucket_, "/", folder_prefix);
  uint64_t entries = 0;
  std::string token;
  for (;;) {
    // The query is in canonical (sorted, encoded) order: libcurl 7.88 signs it
    // as it is written.
    std::vector<std::string> params;
    if (!token.empty()) params.push_back(absl::StrCat("continuation-token=", UriEncode(token, false)));
    params.push_back("delimiter=%2F");
    params.push_back("list-type=2");
    params.push_back("max-keys=1000");
    if (!folder_prefix.empty()) params.push_back(absl::StrCat("prefix=", UriEncode(folder_prefix, false)));
    const std::string url = absl::StrCat(HttpUrl(""), "?", absl::StrJoin(params, "&"));

    std::string body;
    Reply reply;
    reply.on_start = [&](const Reply& r) {
      if (r.http != 200) return absl::UnknownError(absl::StrCat(what, ": unexpected HTTP ", r.http));
      return absl::OkStatus();
    };
    reply.on_body = [&](absl::string_view bytes) {
      if (body.size() + bytes.size() > kMaxListPageBytes) {
        return absl::ResourceExhaustedError(absl::StrCat(what, ": a listing page over ", kMaxListPageBytes, " bytes"));
      }
      body.append(bytes.data(), bytes.size());
      return absl::OkStatus();
    };
    WEIGHTSTORE_RETURN_IF_ERROR(Perform(url, {}, what, &reply));

    bool root = false, truncated = false;
    std::string next_token;
    uint64_t page_entries = 0;
    OriginFile current;
    std::string size_text;
    WEIGHTSTORE_RETURN_IF_ERROR(XmlReader::Parse(body, what, [&](const std::string& path, const std::string& text) {
      if (path == "ListBucketResult") root = true;
      if (path == "ListBucketResult/IsTruncated") truncated = text == "true";
      if (path == "ListBucketResult/NextContinuationToken") next_token = text;
      if (path == "ListBucketResult/CommonPrefixes") ++page_entries;
      if (path == "ListBucketResult/Contents/Key") current.key = text;
      if (path == "ListBucketResult/Contents/Size") size_text = text;
      if (path == "ListBucketResult/Contents/ETag") current.etag = text;
      if (path == "ListBucketResult/Contents") {
        ++page_entries;
        if (!absl::SimpleAtoi(size_text, &current.size)) {
          return absl::DataLossError(
              absl::StrCat(what, ": object '", Shown(current.key), "' has size '", Shown(size_text), "'"));
        }
        // Keys longer than S3 allows (or cut by the reader) can name none of ours.
        if (current.key.size() <= kMaxKeyBytes && absl::StartsWith(current.key, folder_prefix)) {
          objects->push_back(std::move(current));
        }
        current = OriginFile();
        size_text.clear();
      }
      return absl::OkStatus();
    }));
    if (!root) return absl::DataLossError(absl::StrCat(what, ": the reply is not a ListBucketResult"));
    entries += page_entries;
    if (entries > config_.max_list_objects) {
      return absl::ResourceExhaustedError(
          absl::StrCat(what, ": more than ", config_.max_list_objects, " objects and folders"));
    }
    if (!truncated) return absl::OkStatus();
    if (next_token.empty() || next_token.size() >= kMaxXmlText) {
      return absl::DataLossError(absl::StrCat(what, ": a truncated listing page without a usable continuation token"));
    }
    if (page_entries == 0) return absl::DataLossError(absl::StrCat(what, ": a truncated listing page with no entries"));
    token = std::move(next_token);
  }
}

absl::StatusOr<OriginCheckpoint> S3Origin::Find(const std::string& name) { return FindFiles(name, /*describe=*/true); }

absl::StatusOr<std::string> S3Origin::Version(const std::string& name) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(OriginCheckpoint checkpoint, FindFiles(name, /*describe=*/false));
  return checkpoint.version;
}

absl::StatusOr<OriginCheckpoint> S3Origin::FindFiles(const std::string& name, bool describe) {
  if (!IsCleanRelativePath(name)) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint name '", Shown(name),
                                                   "' is not a relative path of [A-Za-z0-9._/-] (no \".\" or \"..\")"));
  }
  const std::string dir = Dirname(name);
  const std::string folder = JoinPath(prefix_, dir);
  const std::string folder_prefix = folder.empty() ? "" : folder + "/";
  const std::string base_key = JoinPath(prefix_, name);

  std::vector<OriginFile> listed;
  WEIGHTSTORE_RETURN_IF_ERROR(List(folder_prefix, &listed));
  absl::flat_hash_map<std::string, const OriginFile*> by_key;
  for (const OriginFile& object : listed) by_key.emplace(object.key, &object);

  // A listed file, checked: its ETag goes into an If-Match header.
  auto take = [&](const std::string& key, std::string path) -> absl::StatusOr<OriginFile> {
    auto it = by_key.find(key);
    if (it == by_key.end()) return absl::NotFoundError(absl::StrCat(ObjectUrl(key), " not found"));
    OriginFile file = *it->second;
    if (file.etag.size() > kMaxHeaderValue || !IsHeaderSafe(file.etag)) {
      return absl::DataLossError(absl::StrCat(ObjectUrl(key), ": the listing gives it ETag '", Shown(file.etag), "'"));
    }
    file.path = std::move(path);
    return file;
  };

  OriginCheckpoint checkpoint;
  checkpoint.name = name;
  absl::string_view extension;
  for (absl::string_view candidate : kExtensions) {
    if (by_key.contains(absl::StrCat(base_key, candidate))) {
      extension = candidate;
      break;
    }
  }
  if (extension.empty()) {
    return absl::NotFoundError(absl::StrCat("checkpoint '", name, "' not found at ", Describe(), " (no ", base_key,
                                            " with ", absl::StrJoin(kExtensions, ", "), ")"));
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(OriginFile main, take(absl::StrCat(base_key, extension), absl::StrCat(name, extension)));

  if (extension == kIndexExtension) {
    const std::string index_url = ObjectUrl(main.key);
    if (main.size > kMaxIndexBytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat(index_url, ": an index of ", main.size, " bytes (at most ", kMaxIndexBytes, ")"));
    }
    std::string text;
    WEIGHTSTORE_RETURN_IF_ERROR(Read(main, 0, main.size, [&text](absl::string_view bytes) {
      text.append(bytes.data(), bytes.size());
      return absl::OkStatus();
    }));
    nlohmann::json index = nlohmann::json::parse(
        text, [](int depth, nlohmann::json::parse_event_t, nlohmann::json&) { return depth <= 8; },
        /*allow_exceptions=*/false);
    if (index.is_discarded() || !index.is_object() || !index.contains("weight_map") ||
        !index["weight_map"].is_object()) {
      return absl::DataLossError(absl::StrCat(index_url, ": not a JSON object with a \"weight_map\" object"));
    }
    const std::string index_base = main.key.substr(folder_prefix.size());
    std::vector<std::string> shards;
    for (const auto& [tensor, shard] : index["weight_map"].items()) {
      if (!shard.is_string()) {
        return absl::DataLossError(absl::StrCat(index_url, ": weight_map entry '", Shown(tensor), "' is not a string"));
      }
      const std::string& shard_name = shard.get_ref<const std::string&>();
      if (!IsCleanRelativePath(shard_name) || absl::StrContains(shard_name, "/") || shard_name == index_base) {
        return absl::DataLossError(absl::StrCat(index_url, ": shard '", Shown(shard_name),
                                                "' is not a file name of [A-Za-z0-9._-] beside the index"));
      }
      shards.push_back(shard_name);
    }
    std::sort(shards.begin(), shards.end());
    shards.erase(std::unique(shards.begin(), shards.end()), shards.end());
    if (shards.size() + 1 > max_files()) {  // before a HEAD per shard
      return absl::FailedPreconditionError(absl::StrCat(
          index_url, " names ", shards.size(), " shards; a checkpoint of at most ", max_files(), " files is pulled"));
    }
    for (const std::string& shard : shards) {
      absl::StatusOr<OriginFile> file = take(folder_prefix + shard, JoinPath(dir, shard));
      if (absl::IsNotFound(file.status())) {
        return absl::NotFoundError(
            absl::StrCat("shard ", ObjectUrl(folder_prefix + shard), " of ", index_url, " not found"));
      }
      if (!file.ok()) return file.status();
      checkpoint.files.push_back(*std::move(file));
    }
  }
  checkpoint.files.push_back(std::move(main));
  if (describe) WEIGHTSTORE_RETURN_IF_ERROR(DescribeAll(&checkpoint.files));

  std::string identity;
  for (const OriginFile& file : checkpoint.files) {
    absl::StrAppend(&identity, file.key, "\n", file.size, "\n", file.etag, "\n");
  }
  checkpoint.version = Sha256Hex(identity);
  return checkpoint;
}

absl::Status S3Origin::DescribeAll(std::vector<OriginFile>* files) {
  // parallel_reads HEADs at once: one round trip each, and an index may have
  // thousands of shards.
  std::atomic<size_t> next{0};
  absl::Mutex mu;
  absl::Status first_error;
  auto work = [&] {
    for (size_t i = next++; i < files->size(); i = next++) {
      absl::Status status = Describe(&(*files)[i]);
      if (status.ok()) continue;
      absl::MutexLock lock(&mu);
      if (first_error.ok()) first_error = status;
      next = files->size();  // the others stop after their HEAD in flight
      return;
    }
  };
  std::vector<std::thread> threads;
  const size_t helpers = std::min<size_t>(std::max(config_.parallel_reads, 1), files->size()) - 1;
  for (size_t i = 0; i < helpers; ++i) {
    try {
      threads.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // fewer at once
    }
  }
  work();
  for (std::thread& t : threads) t.join();
  absl::MutexLock lock(&mu);
  return first_error;
}

absl::Status S3Origin::Describe(OriginFile* file) {
  const std::string what = ObjectUrl(file->key);
  Reply reply;
  reply.on_start = [&](const Reply& r) -> absl::Status {
    if (r.http != 200) return absl::UnknownError(absl::StrCat(what, ": HTTP ", r.http, " to a HEAD"));
    if (!r.etag.empty() && BareEtag(r.etag) != BareEtag(file->etag)) {
      return absl::AbortedError(absl::StrCat(what, " changed at the origin while it was listed (ETag ", Shown(r.etag),
                                             ", listed ", Shown(file->etag), ")"));
    }
    return absl::OkStatus();
  };
  WEIGHTSTORE_RETURN_IF_ERROR(
      Perform(HttpUrl(file->key), {"x-amz-checksum-mode: ENABLED"}, absl::StrCat("HEAD ", what), &reply, true));
  // A KMS- or customer-key-encrypted object's ETag is not the MD5 of its bytes.
  const bool opaque_etag =
      absl::StartsWithIgnoreCase(reply.encryption, "aws:kms") || !reply.customer_encryption.empty();
  file->md5 = opaque_etag ? "" : EtagMd5(file->etag);
  // A versioned bucket names the version the HEAD saw ("null" for an object
  // written while versioning was off or suspended: an overwrite under
  // Enabled keeps it, one under Suspended replaces it, which If-Match then
  // catches).
  const std::string& version = reply.version_id;
  if (!version.empty() && version.size() <= kMaxObjectVersion && IsHeaderSafe(version)) {
    file->object_version = version;
  }
  // A full-object CRC32C (a composite one, of a multipart upload's parts, ends
  // in "-<parts>" and is no checksum of the whole).
  const bool full_object = !reply.checksum_crc32c.empty() && !absl::StrContains(reply.checksum_crc32c, '-') &&
                           !absl::EqualsIgnoreCase(reply.checksum_type, "COMPOSITE");
  if (full_object) {
    std::string crc;
    if (!absl::Base64Unescape(reply.checksum_crc32c, &crc) || crc.size() != 4) {
      return absl::DataLossError(
          absl::StrCat(what, ": x-amz-checksum-crc32c '", Shown(reply.checksum_crc32c), "' is not 4 bytes in base64"));
    }
    file->crc32c = absl::BytesToHexString(crc);
  }
  return absl::OkStatus();
}

absl::Status S3Origin::Read(const OriginFile& file, uint64_t offset, uint64_t length, const ByteSink& sink) {
  const std::string what = ObjectUrl(file.key);
  if (file.key.empty() || file.key.size() > kMaxKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("read of ", what, ": no valid key"));
  }
  if (offset > file.size || length > file.size - offset) {
    return absl::OutOfRangeError(
        absl::StrCat("read of ", what, ": bytes ", offset, "+", length, " beyond its ", file.size, " bytes"));
  }
  if (file.etag.size() > kMaxHeaderValue || !IsHeaderSafe(file.etag)) {
    return absl::InvalidArgumentError(absl::StrCat("read of ", what, ": an ETag that cannot be sent"));
  }
  if (length == 0) return absl::OkStatus();

  const uint64_t last = offset + length - 1;
  // A read of the version listed (its ETag is still sent: a server that
  // ignores versionId then still cannot hand over other bytes).
  const bool pinned = !file.object_version.empty() && !versions_refused_.load();
  std::string url = HttpUrl(file.key);
  if (pinned) absl::StrAppend(&url, "?versionId=", UriEncode(file.object_version, /*keep_slash=*/false));
  std::vector<std::string> headers = {absl::StrCat("Range: bytes=", offset, "-", last)};
  if (!file.etag.empty()) headers.push_back(absl::StrCat("If-Match: ", file.etag));

  uint64_t received = 0;
  Reply reply;
  reply.on_start = [&](const Reply& r) -> absl::Status {
    // A server that ignores If-Match (s3rver does) still names the version it
    // sends.
    if (!file.etag.empty() && !r.etag.empty() && BareEtag(r.etag) != BareEtag(file.etag)) {
      return absl::AbortedError(
          absl::StrCat(what, " changed at the origin (ETag ", Shown(r.etag), ", expected ", Shown(file.etag), ")"));
    }
    if (r.http == 206) {
      // A partial reply must say which bytes it holds (RFC 9110 14.4): exactly
      // those asked for, of an object of the listed size ('*': unknown).
      const std::string range = absl::StrCat("bytes ", offset, "-", last, "/");
      if (r.content_range != absl::StrCat(range, file.size) && r.content_range != absl::StrCat(range, "*")) {
        return absl::DataLossError(
            absl::StrCat(what, ": asked for bytes ", offset, "-", last, " of ", file.size, ", got a 206 with ",
                         r.content_range.empty() ? "no Content-Range"
                                                 : absl::StrCat("Content-Range '", Shown(r.content_range), "'")));
      }
      return absl::OkStatus();
    }
    if (r.http == 200 && offset == 0 && length == file.size) return absl::OkStatus();
    return absl::UnknownError(absl::StrCat(what, ": HTTP ", r.http, " to a request for bytes ", offset, "-", last));
  };
  reply.on_body = [&](absl::string_view bytes) -> absl::Status {
    if (bytes.size() > length - received) {
      return absl::DataLossError(absl::StrCat(what, ": got more than the ", length, " bytes asked for"));
    }
    received += bytes.size();
    return sink(bytes);
  };
  absl::Status status = Perform(url, headers, what, &reply);
  if (pinned && !status.ok() && received == 0 && !reply.ok_status() && reply.http != 0) {
    const std::string code = ErrorCode(reply.error_body);
    if (RefusesVersionReads(reply.http, code)) {
      // Read again by ETag alone. Only once that succeeds does this origin
      // stop asking for versions (as from a bucket that keeps none): a
      // refusal the ETag read meets too is no verdict on versions.
      OriginFile by_etag = file;
      by_etag.object_version.clear();
      absl::Status again = Read(by_etag, offset, length, sink);
      if (again.ok() && !versions_refused_.exchange(true)) {
        std::fprintf(stderr,
                     "weightstored: origin: %s refuses reads of object versions (HTTP %ld %s); reading by ETag "
                     "alone from now on, so an object overwritten mid-pull ends the pull\n",
                     Describe().c_str(), reply.http, Shown(code).c_str());
      }
      return again;
    }
    if (reply.http == 404 && code == "NoSuchVersion") {
      // Deleted (or expired) since the listing: the object changed, as far
      // as this pull can tell.
      return absl::AbortedError(absl::StrCat(what, " changed at the origin (its version ", Shown(file.object_version),
                                             " is gone: ", status.message(), ")"));
    }
  }
  if (reply.curl_code == CURLE_PARTIAL_FILE && reply.stopped.ok()) {
    return absl::DataLossError(absl::StrCat(what, ": got ", received, " of ", length, " bytes (from offset ", offset,
                                            "; the connection closed early)"));
  }
  WEIGHTSTORE_RETURN_IF_ERROR(status);
  if (received != length) {
    return absl::DataLossError(
        absl::StrCat(what, ": got ", received, " of ", length, " bytes (from offset ", offset, ")"));
  }
  return absl::OkStatus();
}

}  // namespace weightstore::origin
