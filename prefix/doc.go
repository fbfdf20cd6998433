// Package prefix is the one prompt-prefix contract that the gateway's filter,
// the metadata center and the workers share (docs/architecture.md, "Prompt
// hashing"). A worker and a gateway that disagree on any of it index the same
// prompt under different keys and the router silently stops finding caches,
// so nothing here may be reimplemented elsewhere.
//
// Three steps, kept separate so that every party can reproduce them:
//
//  1. Canonical bytes (canonical.go): CanonicalChat / CanonicalCompletion
//     render a prompt into one byte string that is injective (different
//     prompts never render the same) and prefix-preserving (a conversation
//     that extends another renders to an extension of its bytes, so shared
//     history shares blocks). ChatMessage holds the OpenAI message rules.
//  2. Hasher.Sum (hasher.go) cuts those bytes into UTF-8-safe blocks of
//     ChunkSize bytes, a block ending early where a chat message starts, and
//     chains 64-bit murmur3 over them; element i names the whole prefix up
//     to block i.
//  3. Hash (hash.go) is one such value; its only wire form is 16 lowercase
//     hex digits (Hash.String, Wire, ParseHash).
package prefix
