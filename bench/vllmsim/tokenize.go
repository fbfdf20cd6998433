package vllmsim

import "hash/fnv"

// BytesPerToken is about how many bytes of the bench's workload text make
// one token of Tokenize (tokenize_test.go measures it on workload.Text).
// The bench converts workload sizes given in tokens to bytes with it.
const BytesPerToken = 3.6

// maxPiece bounds a word piece, as merges in a BPE vocabulary of a few tens
// of thousands of entries rarely produce tokens longer than a short word.
const maxPiece = 5

// Tokenize splits text into BPE-like pieces and returns their ids: a run of
// letters or digits is cut into pieces of at most maxPiece bytes, the first
// carrying the single space before it (as GPT-style vocabularies attach the
// leading space to a word); every other byte is a piece of its own. So
// English-like text costs about BytesPerToken bytes a token, never one byte
// a token as on the byte-level test model, and the same text always gives the
// same ids. An id is the FNV-1a hash of the piece's bytes.
func Tokenize(text string) []uint32 {
	ids := make([]uint32, 0, len(text)/3+1)
	for _, p := range pieces(text) {
		ids = append(ids, pieceID(p))
	}
	return ids
}

func pieces(text string) []string {
	var out []string
	i := 0
	for i < len(text) {
		start := i
		if text[i] == ' ' && i+1 < len(text) && isWord(text[i+1]) {
			i++ // the space joins the word's first piece
		}
		if !isWord(text[i]) {
			out = append(out, text[start:i+1])
			i++
			continue
		}
		for i < len(text) && isWord(text[i]) && i-start < maxPiece {
			i++
		}
		out = append(out, text[start:i])
	}
	return out
}

func isWord(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

func pieceID(p string) uint32 {
	h := fnv.New32a()
	h.Write([]byte(p))
	return h.Sum32()
}

// outputPieces are what the simulated model writes: words of at most
// maxPiece bytes with their leading space, so that an answer sent back in the
// next turn tokenizes to exactly the tokens generated (its KV blocks hit).
var outputPieces = []string{" the", " of", " and", " to", " in", " is", " a", " for", " on", " that",
	" with", " as", " by", " this", " be", " are", " from", " at", " or", " an", " it", " not"}
