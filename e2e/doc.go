// Package e2e holds the end-to-end tests of the whole system: real processes
// (metadata center, llama.cpp workers on the generated model, the standalone
// gateway) on loopback, driven by the official OpenAI Go SDK as a user would.
package e2e
