package llmfilter

import (
	"encoding/json"
	"net/http"
	"slices"
	"strings"

	"github.com/envoyproxy/envoy/contrib/golang/common/go/api"

	"github.com/istio-llm-filter/istio-llm-filter/filter/engine"
	"github.com/istio-llm-filter/istio-llm-filter/filter/transcode"
)

// ClusterHeader carries the chosen rule's cluster to Envoy's route, which
// forwards on it (route.cluster_header, istio/gateway.yaml). The filter
// removes any value a client sent.
const ClusterHeader = "x-llm-cluster"

// answered marks a local reply that is an answer, not an error (the model
// list): OnLog and the encode phases treat it like any local reply.
const answered = "answered"

// modelObject is one entry of OpenAI's GET /v1/models list.
type modelObject struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	OwnedBy string `json:"owned_by"`
}

type modelList struct {
	Object string        `json:"object"`
	Data   []modelObject `json:"data"`
}

func modelOf(id string) modelObject {
	return modelObject{ID: id, Object: "model", OwnedBy: "llm-filter"}
}

// bodylessReply answers, before any routing, the requests the gateway
// serves itself or refuses: GET /v1/models (and /v1/models/{id}) from the
// configured model rules, as no single pod knows every model behind the
// gateway; and a POST without a body, which no endpoint accepts (routed
// to a pod it would fail there, or find no pod at all). nil: go on.
func (f *filter) bodylessReply(h api.RequestHeaderMap, endStream bool) *engine.Error {
	method := h.Method()
	path, _, _ := strings.Cut(h.Path(), "?")
	if method == http.MethodGet && f.conf.cfg.Protocol == "openai" {
		if path == "/v1/models" {
			list := modelList{Object: "list", Data: []modelObject{}}
			for _, id := range f.models() {
				list.Data = append(list.Data, modelOf(id))
			}
			b, _ := json.Marshal(list)
			return &engine.Error{Status: http.StatusOK, Type: answered, Message: string(b)}
		}
		if id, ok := strings.CutPrefix(path, "/v1/models/"); ok && id != "" {
			if _, known := f.conf.cfg.ModelMappingRule[id]; !known {
				return &engine.Error{Status: http.StatusNotFound, Type: transcode.TypeNotFound,
					Message: "model not found: " + id, TraceID: f.trace()}
			}
			b, _ := json.Marshal(modelOf(id))
			return &engine.Error{Status: http.StatusOK, Type: answered, Message: string(b)}
		}
	}
	if endStream && (method == http.MethodPost || method == http.MethodPut || method == http.MethodPatch) {
		return &engine.Error{Status: http.StatusBadRequest, Type: transcode.TypeBadRequest,
			Message: "request body is required: " + method + " " + path + " carries a JSON document", TraceID: f.trace()}
	}
	return nil
}

func (f *filter) models() []string {
	ids := make([]string, 0, len(f.conf.cfg.ModelMappingRule))
	for id := range f.conf.cfg.ModelMappingRule {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}
