// Package e2e holds the end-to-end tests of the whole system: real processes
// (metadata center, llama.cpp workers on the generated model) on loopback,
// driven by the official OpenAI Go SDK as a user would, through each way into
// the fleet: the standalone gateway, the real .so in the Envoy-faithful host
// (envoyhost/), and the upstream Envoy with our endpoint picker (filter/epp;
// $LLMF_TEST_ENVOY, which scripts/test.sh installs).
package e2e
