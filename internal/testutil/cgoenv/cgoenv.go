// Package cgoenv gives tests that build the worker (which compiles
// llama.cpp through cgo) the C flags the Makefile exports, when they run
// outside make.
package cgoenv

import "os"

// Flags are the Makefile's (and scripts/cgo-env.sh's) C flags for llama.cpp:
// the host's vector instructions (ggml's own flags are plain -O3, ~20x
// slower prefill) without AMX, whose buffer type ollama's cgo package does
// not compile (on CPUs with AMX the link fails). Keep the three equal so
// the build cache is shared.
const Flags = "-O3 -march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

// Environ is os.Environ() with CGO_CFLAGS and CGO_CXXFLAGS set to Flags
// where the environment leaves them unset.
func Environ() []string {
	env := os.Environ()
	for _, k := range []string{"CGO_CFLAGS", "CGO_CXXFLAGS"} {
		if os.Getenv(k) == "" {
			env = append(env, k+"="+Flags)
		}
	}
	return env
}
