package e2e

import (
	"errors"
	"math/rand/v2"

	"github.com/openai/openai-go"
)

func newRand(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, 99)) }

func asAPIError(err error, target **openai.Error) bool { return errors.As(err, target) }
