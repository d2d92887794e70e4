// voicechat's ops from C++: loads the inputs and expected outputs make_inputs.py wrote, runs the RVQ
// search, the rel-pos attention and a Mamba-2 scan step on the CPU stream, and checks each result.
// Exits 1 on a mismatch.
//
//   voicechat_example example.safetensors
#include <cstdio>
#include <limits>
#include <optional>
#include <string>

#include "mlx/mlx.h"
#include "voicechat/voicechat.h"

namespace mx = mlx::core;

namespace {

int failures = 0;

// got against want: the same shape and dtype, and equal (integers) or within tol (floats).
void check(const char* what, const mx::array& got, const mx::array& want, float tol) {
  bool ok = got.shape() == want.shape() && got.dtype() == want.dtype();
  float error = 0.0f;
  if (ok) {
    const auto diff = mx::abs(mx::subtract(mx::astype(got, mx::float32), mx::astype(want, mx::float32)));
    error = mx::max(diff).item<float>();
    ok = error <= tol;
  }
  std::printf("%-22s %-8s max |error| %.3g\n", what, ok ? "ok" : "MISMATCH", error);
  failures += ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s INPUTS.safetensors (written by make_inputs.py)\n", argv[0]);
    return 2;
  }
  const mx::Stream cpu = mx::default_stream(mx::Device::cpu);
  const auto [arrays, meta] = mx::load_safetensors(argv[1], cpu);
  auto in = [&arrays](const std::string& key) { return arrays.at(key); };
  auto number = [&meta](const std::string& key) { return std::stod(meta.at(key)); };

  // RVQ: codebooks [start, start + count) over one residual row
  const auto rvq = voicechat::rvq_search(in("rvq.residual"), in("rvq.codebooks"), in("rvq.norms"),
                                         static_cast<int>(number("rvq.start")), static_cast<int>(number("rvq.count")),
                                         "auto", std::nullopt, cpu);
  check("rvq_search codes", rvq[0], in("rvq.codes"), 0.0f);
  check("rvq_search residual", rvq[1], in("rvq.residual_out"), 1e-4f);

  // FastConformer rel-pos attention with the chunked-limited mask
  const auto attention = voicechat::rel_pos_attention(
      in("rel.q"), in("rel.k"), in("rel.v"), in("rel.p"), in("rel.pos_bias_u"), in("rel.pos_bias_v"),
      static_cast<float>(number("rel.scale")), static_cast<int>(number("rel.left")),
      static_cast<int>(number("rel.right")), 0, std::nullopt, "auto", cpu);
  check("rel_pos_attention", attention, in("rel.out"), 1e-4f);

  // one Mamba-2 decode step from a state
  const auto scan = voicechat::mamba_scan(in("mamba.x"), in("mamba.dt"), in("mamba.A_log"), in("mamba.B"),
                                          in("mamba.C"), in("mamba.D"), in("mamba.dt_bias"), in("mamba.state"), 0.0f,
                                          std::numeric_limits<float>::infinity(), "auto", cpu);
  check("mamba_scan y", scan[0], in("mamba.y"), 1e-4f);
  check("mamba_scan state", scan[1], in("mamba.state_out"), 1e-4f);

  std::printf("%s\n", failures == 0 ? "all match" : "MISMATCH");
  return failures == 0 ? 0 : 1;
}
