package lifecycle

import "github.com/istio-llm-filter/istio-llm-filter/filter/routing/routingtest"

// The fixtures shared with the tests of filter/routing (routingtest).
const cluster = routingtest.Cluster

var pods = routingtest.Pods

type (
	hdr    = routingtest.Headers
	counts = routingtest.Counts
)

var (
	chatPath     = routingtest.ChatPath
	quiet        = routingtest.Quiet
	center       = routingtest.Center
	configFor    = routingtest.Config
	staticSource = routingtest.StaticSource
	chatBody     = routingtest.ChatBody
)
