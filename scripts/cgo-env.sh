# Sourced by the scripts that build llama.cpp when they run outside make; the
# Makefile exports the same flags (and internal/testutil/cgoenv gives them to
# tests that build the worker). -march=native: ggml's own cgo flags are
# plain -O3, and prefill is ~20x slower without the host's vector
# instructions. -mno-amx-*: on CPUs with AMX (Xeon Sapphire Rapids and
# later) -march=native makes ggml-cpu call its AMX buffer type, whose source
# ollama's cgo package does not compile, and the link fails.
flags="-O3 -march=${LLMF_MARCH:-native} -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
export CGO_CFLAGS="${CGO_CFLAGS:-$flags}" CGO_CXXFLAGS="${CGO_CXXFLAGS:-$flags}"
unset flags
