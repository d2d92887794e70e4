#include "cuda/cuda_sources.h"

#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string_view>

#include "mlx/mlx.h"
#include "cuda/own_launch.h"
#include "jit_sources.h"

namespace voicechat {

namespace {
std::deque<CudaSource>& storage() {
  static std::deque<CudaSource> list;  // a deque: references stay valid as kernels register
  return list;
}
}  // namespace

std::string compact_kernel_text(const std::string& text) {
  // One pass that drops comments (a // comment whose line ends in a backslash goes on to the next
  // line, as the preprocessor splices it), copying string and character literals as they are; then
  // each line trimmed, and empty lines dropped unless the line before continues (ends in a backslash).
  std::string code;
  code.reserve(text.size());
  const size_t n = text.size();
  for (size_t i = 0; i < n;) {
    const char c = text[i];
    if (c == '/' && i + 1 < n && text[i + 1] == '/') {
      while (i < n && !(text[i] == '\n' && text[i - 1] != '\\')) ++i;  // stops at the line's end
    } else if (c == '/' && i + 1 < n && text[i + 1] == '*') {
      const size_t end = text.find("*/", i + 2);
      if (end == std::string::npos) throw std::invalid_argument("compact_kernel_text: an unterminated /* comment");
      code += ' ';
      i = end + 2;
    } else if (c == '"' || c == '\'') {
      size_t j = i + 1;
      while (j < n && text[j] != c && text[j] != '\n') j += text[j] == '\\' ? 2 : 1;
      if (j >= n || text[j] != c) throw std::invalid_argument("compact_kernel_text: an unterminated literal");
      code.append(text, i, j + 1 - i);
      i = j + 1;
    } else {
      code += c;
      ++i;
    }
  }
  std::string out;
  out.reserve(code.size());
  bool continues = false;  // the last line kept ends in a backslash
  for (size_t start = 0; start < code.size();) {
    size_t end = code.find('\n', start);
    if (end == std::string::npos) end = code.size();
    size_t a = start, b = end;
    while (a < b && std::isspace(static_cast<unsigned char>(code[a]))) ++a;
    while (b > a && std::isspace(static_cast<unsigned char>(code[b - 1]))) --b;
    if (b > a || continues) {
      out.append(code, a, b - a);
      out += '\n';
      continues = b > a && code[b - 1] == '\\';
    }
    start = end + 1;
  }
  return out;
}

const CudaSource& register_cuda_source(CudaSource source) {
  // Compact texts compile sooner and, where they go inline (see launch_text), cost less at every
  // launch: MLX-CUDA hashes the whole text then.
  source.header = compact_kernel_text(source.header);
  source.source = compact_kernel_text(source.source);
  storage().push_back(std::move(source));
  return storage().back();
}

const std::deque<CudaSource>& cuda_sources() { return storage(); }

std::string jit_name(const CudaSource& source) {
  // FNV-1a (64 bit) over the header, the body and the argument names, each ended by a NUL.
  std::uint64_t h = 1469598103934665603ULL;
  auto feed = [&h](const std::string& text) {
    for (unsigned char c : text) {
      h = (h ^ c) * 1099511628211ULL;
    }
    h = (h ^ 0) * 1099511628211ULL;
  };
  feed(source.header);
  feed(source.source);
  for (const auto& n : source.input_names) feed(n);
  for (const auto& n : source.output_names) feed(n);
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  return source.name + "_" + std::string(hex, 12);
}

std::string file_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

void write_file_whole(const std::filesystem::path& path, const std::string& bytes) {
  std::filesystem::create_directories(path.parent_path());
  static std::atomic<unsigned> written{0};  // with the pid: a scratch name no other writer has
  auto scratch = path;
  scratch += "." + std::to_string(::getpid()) + "." + std::to_string(written++) + ".tmp";
  try {
    std::ofstream out(scratch, std::ios::binary | std::ios::trunc);
    out << bytes;
    out.close();
    if (!out) throw std::runtime_error("cannot write " + scratch.string());
    std::filesystem::rename(scratch, path);
  } catch (...) {
    std::error_code ignored;
    std::filesystem::remove(scratch, ignored);  // no partial file left behind
    throw;
  }
}

namespace {
// `path` holding exactly `text`: left as it is when it does, else written whole (processes racing
// write the same bytes; none reads a torn file). Throws when it cannot.
void ensure_file_text(const std::filesystem::path& path, const std::string& text) {
  if (std::filesystem::is_regular_file(path) && file_text(path) == text) return;
  write_file_whole(path, text);
  if (file_text(path) != text) throw std::runtime_error("cannot read back " + path.string());
}

std::string include_line(const std::filesystem::path& path) { return "#include \"" + path.string() + "\"\n"; }
}  // namespace

KernelText launch_text(const CudaSource& source, const std::string& folder) {
  KernelText inline_text{source.header, source.source, false};
  // A path an #include line cannot carry as it is, or none: the texts go inline.
  if (folder.empty() || folder.find_first_of("\"\\\n") != std::string::npos) return inline_text;
  const std::string name = jit_name(source);  // hashes both texts: a file's name is its content's
  std::filesystem::path header_file, body_file;
  try {
    const auto dir = std::filesystem::absolute(folder);  // NVRTC resolves a relative one from the cwd
    header_file = dir / (name + ".cuh");
    body_file = dir / (name + ".body.cuh");
    ensure_file_text(header_file, source.header);
    ensure_file_text(body_file, source.source);
  } catch (const std::exception&) {
    return inline_text;  // an unwritable folder costs launch time, never a kernel
  }
  KernelText text{include_line(header_file), include_line(body_file), true};
  // MLX passes an input's shape, strides or ndim only where the body it is given names them.
  std::string named;
  for (const auto& input : source.input_names) {
    for (const char* what : {"_shape", "_strides", "_ndim"}) {
      if (source.source.find(input + what) != std::string::npos) named += " " + input + what;
    }
  }
  if (!named.empty()) text.body += "//" + named + "\n";
  return text;
}

std::string kernel_text_folder() {
  const char* folder = std::getenv("VOICECHAT_KERNEL_TEXT_DIR");
  return folder == nullptr ? std::string() : std::string(folder);
}

namespace {
mlx::core::fast::CustomKernelFunction mlx_launch(const CudaSource& source, int shared_memory) {
  const KernelText text = launch_text(source, kernel_text_folder());
  return mlx::core::fast::cuda_kernel(jit_name(source), source.input_names, source.output_names, text.body,
                                      text.header, true, shared_memory);
}
}  // namespace

mlx::core::fast::CustomKernelFunction make_cuda_kernel(const CudaSource& source, int shared_memory) {
  if (source.cluster > 1) {
    // MLX's launch would run the blocks as clusters of one: never handed to it
    const std::string name = source.name;
    auto refuse = [name]() -> mlx::core::fast::CustomKernelFunction {
      throw std::runtime_error(name + ": a kernel of thread-block clusters runs only through voicechat's own "
                               "launch (a CUDA build, VOICECHAT_OWN_LAUNCH not 0, no fallback to MLX's launch)");
    };
    if (!own_launch_wanted() || !own_launch_built()) return refuse();
    return make_own_kernel(source, shared_memory, refuse);
  }
  if (own_launch_wanted() && own_launch_built()) {
    return make_own_kernel(source, shared_memory, [&source, shared_memory] { return mlx_launch(source, shared_memory); });
  }
  return mlx_launch(source, shared_memory);
}

bool own_launch_active() { return own_launch_built() && own_launch_wanted() && !own_launch_fallback(); }

bool cuda_build() { return std::string_view(VC_BACKEND) == "cuda"; }

bool gpu_stream(const mlx::core::Stream& s) { return s.device == mlx::core::Device::gpu; }

bool float_dtype(mlx::core::Dtype t) {
  return t == mlx::core::float32 || t == mlx::core::bfloat16 || t == mlx::core::float16;
}

std::string int_arg(int v) { return "int:" + std::to_string(v); }

int float_bits(float f) {
  int i;
  std::memcpy(&i, &f, sizeof(i));
  if (i < 0) {
    throw std::invalid_argument("float_bits: " + std::to_string(f) + " is negative (pass its magnitude and a sign)");
  }
  return i;
}

const mlx::core::array& kept_ints(const std::vector<int>& values) {
  static std::mutex lock;
  static auto* kept = new std::map<std::vector<int>, mlx::core::array>();  // never freed: outlives the runtime
  std::lock_guard<std::mutex> guard(lock);
  auto it = kept->find(values);
  if (it == kept->end()) {
    mlx::core::array a(values.begin(), mlx::core::Shape{static_cast<int>(values.size())}, mlx::core::int32);
    mlx::core::eval(a);
    it = kept->emplace(values, a).first;
  }
  return it->second;
}

std::string type_arg(const std::string& cuda_type) { return "type:" + cuda_type; }

const std::string& block_reduce_header() {
  static const std::string text = jit::common::block_reduce;
  return text;
}

const std::string& head_norm_rope_header() {
  static const std::string text = jit::common::head_norm_rope;
  return text;
}

}  // namespace voicechat
