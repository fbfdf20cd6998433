package llmfilter

import (
	"context"
	"encoding/json"
	"net/http"
	"slices"
	"strings"

	"github.com/envoyproxy/envoy/contrib/golang/common/go/api"

	"github.com/istio-llm-filter/istio-llm-filter/filter/routing"
	"github.com/istio-llm-filter/istio-llm-filter/filter/transcode"
)

// answered marks a local reply that is an answer, not an error (the model
// list): OnLog and the encode phases treat it like any local reply.
const answered = "answered"

// modelObject is one entry of OpenAI's GET /v1/models list.
type modelObject struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	OwnedBy string `json:"owned_by"`
	// Parent is the base model of a LoRA adapter (vLLM's field).
	Parent string `json:"parent,omitempty"`
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
func (f *filter) bodylessReply(h api.RequestHeaderMap, endStream bool) *routing.Error {
	method := h.Method()
	path, _, _ := strings.Cut(h.Path(), "?")
	if method == http.MethodGet && f.conf.cfg.Protocol == "openai" {
		if path == "/v1/models" {
			return answer(f.modelList(nil))
		}
		if id, ok := strings.CutPrefix(path, "/v1/models/"); ok && id != "" {
			if _, known := f.conf.cfg.ModelMappingRule[id]; !known {
				return f.unknownModel(id)
			}
			return answer(modelOf(id))
		}
	}
	if endStream && (method == http.MethodPost || method == http.MethodPut || method == http.MethodPatch) {
		return &routing.Error{Status: http.StatusBadRequest, Type: transcode.TypeBadRequest,
			Message: "request body is required: " + method + " " + path + " carries a JSON document", TraceID: f.trace()}
	}
	return nil
}

// modelList is the configured models, sorted, then the adapters that are
// not also a configured model's name.
func (f *filter) modelList(adapters []routing.Adapter) modelList {
	ids := make([]string, 0, len(f.conf.cfg.ModelMappingRule))
	for id := range f.conf.cfg.ModelMappingRule {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	list := modelList{Object: "list", Data: make([]modelObject, 0, len(ids)+len(adapters))}
	for _, id := range ids {
		list.Data = append(list.Data, modelOf(id))
	}
	for _, a := range adapters {
		if _, dup := f.conf.cfg.ModelMappingRule[a.ID]; !dup {
			list.Data = append(list.Data, adapterOf(a))
		}
	}
	return list
}

func adapterOf(a routing.Adapter) modelObject {
	o := modelOf(a.ID)
	o.Parent = a.Parent
	return o
}

// answer is a local reply that answers with v's JSON.
func answer(v any) *routing.Error {
	b, _ := json.Marshal(v)
	return &routing.Error{Status: http.StatusOK, Type: answered, Message: string(b)}
}

func (f *filter) unknownModel(id string) *routing.Error {
	return &routing.Error{Status: http.StatusNotFound, Type: transcode.TypeNotFound, Message: "model not found: " + id, TraceID: f.trace()}
}

// modelsQuery says whether GET /v1/models or /v1/models/{id} must look at
// the registered adapters, which the metadata center knows: the whole list
// does, and an id that is no configured model may be an adapter.
func (f *filter) modelsQuery(h api.RequestHeaderMap) (id string, ok bool) {
	if h.Method() != http.MethodGet || f.conf.cfg.Protocol != "openai" || !f.conf.router.ListsAdapters() {
		return "", false
	}
	path, _, _ := strings.Cut(h.Path(), "?")
	if path == "/v1/models" {
		return "", true
	}
	if id, ok := strings.CutPrefix(path, "/v1/models/"); ok && id != "" {
		_, known := f.conf.cfg.ModelMappingRule[id]
		return id, !known
	}
	return "", false
}

// listModels answers a models query on a goroutine (it waits on the
// metadata center, never on Envoy's thread): the configured models, then
// the adapters registered pods serve. Without an answer from the metadata
// center the list has the configured models only.
func (f *filter) listModels(ctx context.Context, cancel context.CancelFunc, id string) {
	defer cancel()
	defer func() {
		if e := recover(); e != nil {
			f.asyncPanic(e)
		}
	}()
	adapters, err := f.conf.router.Adapters(ctx)
	if err != nil {
		f.log.Warn("model list: the registered adapters are not known", "trace_id", f.trace(), "err", err)
	}
	var lr *routing.Error
	if id == "" {
		lr = answer(f.modelList(adapters))
	} else {
		lr = f.unknownModel(id)
		if i := slices.IndexFunc(adapters, func(a routing.Adapter) bool { return a.ID == id }); i >= 0 {
			lr = answer(adapterOf(adapters[i]))
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.destroyed {
		return
	}
	f.reply(f.cb.DecoderFilterCallbacks(), lr)
}
