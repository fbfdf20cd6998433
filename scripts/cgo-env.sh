# Sourced by the scripts that build llama.cpp when they run outside make; the
# Makefile exports the same flags (and internal/testutil/cgoenv gives them to
# tests that build the worker). -march=native: ggml's own cgo flags are
# plain -O3, and prefill is ~20x slower without the host's vector
# instructions. -mno-amx-*: on CPUs with AMX (Xeon Sapphire Rapids and
# later) -march=native makes ggml-cpu call its AMX buffer type, whose source
# ollama's cgo package does not compile, and the link fails.
# (x86 only: other compilers do not know the options.) The container images
# set LLMF_MARCH to a portable level (deploy/images/*.Dockerfile).
flags="-O3 -march=${LLMF_MARCH:-native}"
case "$(uname -m)" in
  x86_64 | amd64) flags="$flags -mno-amx-tile -mno-amx-int8 -mno-amx-bf16" ;;
esac
export CGO_CFLAGS="${CGO_CFLAGS:-$flags}" CGO_CXXFLAGS="${CGO_CXXFLAGS:-$flags}"
unset flags
