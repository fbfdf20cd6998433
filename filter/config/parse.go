package config

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
)

// FieldError is one refused key: Path is the dotted key path
// ("metadata_center.query_timeout", `model_mapping_rule.qwen[0].cluster`).
type FieldError struct {
	Path, Msg string
}

func (e *FieldError) Error() string {
	if e.Path == "" {
		return e.Msg
	}
	return e.Path + ": " + e.Msg
}

// Parse reads the `filter:` document from YAML or JSON (JSON is YAML).
// All problems are reported at once, joined, each naming its key path.
func Parse(doc []byte) (*Config, error) {
	j, err := yaml.YAMLToJSON(doc)
	if err != nil {
		return nil, fmt.Errorf("config: not valid YAML or JSON: %w", err)
	}
	dec := json.NewDecoder(bytes.NewReader(j))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	if v == nil {
		v = map[string]any{}
	}
	return FromValue(v)
}

// FromValue validates an already decoded document (maps, slices, strings,
// float64 or json.Number numbers, bools), e.g. the `filter:` subtree of the
// standalone gateway's own file.
func FromValue(v any) (*Config, error) {
	d := &decoder{}
	cfg := d.config(v)
	if len(d.errs) > 0 {
		return nil, errors.Join(d.errs...)
	}
	return cfg, nil
}

type decoder struct{ errs []error }

func (d *decoder) fail(path, format string, args ...any) {
	d.errs = append(d.errs, &FieldError{Path: path, Msg: fmt.Sprintf(format, args...)})
}

// plainKey reports whether key can be shown bare in a path.
func plainKey(key string) bool {
	if key == "" {
		return false
	}
	for i := 0; i < len(key); i++ {
		c := key[i]
		if !(c == '_' || c == '-' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || i > 0 && c >= '0' && c <= '9') {
			return false
		}
	}
	return true
}

func join(path, key string) string {
	if !plainKey(key) {
		key = strconv.Quote(key)
		if path == "" {
			return "[" + key + "]"
		}
		return path + "[" + key + "]"
	}
	if path == "" {
		return key
	}
	return path + "." + key
}

// object returns v as an object whose keys are all in allowed (nil = any).
func (d *decoder) object(path string, v any, allowed ...string) (map[string]any, bool) {
	m, ok := v.(map[string]any)
	if !ok {
		d.fail(path, "must be an object, got %s", kind(v))
		return nil, false
	}
	if allowed != nil {
		for _, k := range sortedKeys(m) {
			if !slices.Contains(allowed, k) {
				d.fail(join(path, k), "unknown key (allowed: %s)", strings.Join(allowed, ", "))
			}
		}
	}
	return m, true
}

func sortedKeys[V any](m map[string]V) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

func kind(v any) string {
	switch v.(type) {
	case nil:
		return "null"
	case map[string]any:
		return "an object"
	case []any:
		return "a list"
	case string:
		return "a string"
	case bool:
		return "a boolean"
	case float64, json.Number:
		return "a number"
	}
	return fmt.Sprintf("%T", v)
}

func (d *decoder) str(path string, m map[string]any, key, def string) string {
	v, ok := m[key]
	if !ok || v == nil {
		return def
	}
	s, ok := v.(string)
	if !ok {
		d.fail(join(path, key), "must be a string, got %s", kind(v))
		return def
	}
	return s
}

func (d *decoder) boolean(path string, m map[string]any, key string, def bool) bool {
	v, ok := m[key]
	if !ok || v == nil {
		return def
	}
	b, ok := v.(bool)
	if !ok {
		d.fail(join(path, key), "must be true or false, got %s", describe(v))
		return def
	}
	return b
}

func number(v any) (float64, bool) {
	switch n := v.(type) {
	case float64:
		return n, true
	case json.Number:
		f, err := n.Float64()
		return f, err == nil
	}
	return 0, false
}

func (d *decoder) integer(path string, m map[string]any, key string, def, lo, hi int) int {
	v, ok := m[key]
	if !ok || v == nil {
		return def
	}
	p := join(path, key)
	f, ok := number(v)
	if !ok || f != math.Trunc(f) {
		d.fail(p, "must be an integer, got %s", describe(v))
		return def
	}
	if f < float64(lo) || f > float64(hi) {
		d.fail(p, "must be in %d..%d, got %v", lo, hi, describe(v))
		return def
	}
	return int(f)
}

func (d *decoder) float(path string, m map[string]any, key string, def, lo, hi float64) float64 {
	v, ok := m[key]
	if !ok || v == nil {
		return def
	}
	p := join(path, key)
	f, ok := number(v)
	if !ok || math.IsNaN(f) || math.IsInf(f, 0) {
		d.fail(p, "must be a number, got %s", describe(v))
		return def
	}
	if f < lo || f > hi {
		d.fail(p, "must be in %g..%g, got %g", lo, hi, f)
		return def
	}
	return f
}

func (d *decoder) duration(path string, m map[string]any, key string, def, lo, hi time.Duration) time.Duration {
	v, ok := m[key]
	if !ok || v == nil {
		return def
	}
	p := join(path, key)
	s, ok := v.(string)
	if !ok {
		d.fail(p, "must be a duration string such as \"100ms\", got %s", describe(v))
		return def
	}
	dur, err := time.ParseDuration(s)
	if err != nil {
		d.fail(p, "must be a duration such as \"100ms\", got %q", s)
		return def
	}
	if dur < lo || dur > hi {
		d.fail(p, "must be in %v..%v, got %v", lo, hi, dur)
		return def
	}
	return dur
}

func describe(v any) string {
	switch x := v.(type) {
	case string:
		return strconv.Quote(x)
	case json.Number:
		return x.String()
	case float64:
		return strconv.FormatFloat(x, 'g', -1, 64)
	}
	return kind(v)
}

func (d *decoder) stringMap(path string, v any) map[string]string {
	m, ok := d.object(path, v)
	if !ok {
		return nil
	}
	out := make(map[string]string, len(m))
	for _, k := range sortedKeys(m) {
		s, ok := m[k].(string)
		if !ok {
			// Numbers and booleans are common YAML slips (x-env: 1).
			switch m[k].(type) {
			case json.Number, float64, bool:
				s = fmt.Sprint(m[k])
			default:
				d.fail(join(path, k), "must be a string, got %s", kind(m[k]))
				continue
			}
		}
		if k == "" {
			d.fail(path, "empty name")
			continue
		}
		out[k] = s
	}
	return out
}

func checkURL(raw string) error {
	u, err := url.Parse(raw)
	if err != nil {
		return fmt.Errorf("must be an http(s) URL: %v", err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return fmt.Errorf("must be an http(s) URL, got %q", raw)
	}
	if u.Host == "" || u.Hostname() == "" {
		return fmt.Errorf("must name a host, got %q", raw)
	}
	if u.RawQuery != "" || u.Fragment != "" || u.User != nil {
		return fmt.Errorf("must not carry a query, fragment or credentials, got %q", raw)
	}
	if p := u.Port(); p != "" {
		if n, err := strconv.Atoi(p); err != nil || n < 1 || n > 65535 {
			return fmt.Errorf("has an invalid port, got %q", raw)
		}
	}
	return nil
}

func (d *decoder) config(v any) *Config {
	cfg := &Config{}
	m, ok := d.object("", v, "protocol", "metadata_center", "prompt_hash", "model_mapping_rule",
		"lb_mapping_rule", "endpoints", "async", "max_body_bytes", "tracing")
	if !ok {
		return cfg
	}
	cfg.Protocol = d.str("", m, "protocol", DefaultProtocol)
	if cfg.Protocol == "" {
		d.fail("protocol", "must not be empty")
	}
	cfg.MetadataCenter = d.metadataCenter(m["metadata_center"])
	cfg.PromptHash = PromptHash{ChunkSize: DefaultChunkSize}
	if v, ok := m["prompt_hash"]; ok && v != nil {
		if pm, ok := d.object("prompt_hash", v, "chunk_size"); ok {
			cfg.PromptHash.ChunkSize = d.integer("prompt_hash", pm, "chunk_size", DefaultChunkSize, 16, 1<<20)
		}
	}
	cfg.ModelMappingRule = d.models(m["model_mapping_rule"])
	cfg.LBMappingRule = d.lbMapping(m["lb_mapping_rule"])
	cfg.Endpoints = d.endpoints(m["endpoints"])
	cfg.Async = d.async(m["async"])
	cfg.MaxBodyBytes = d.integer("", m, "max_body_bytes", DefaultMaxBodyBytes, 1, 1<<30)
	cfg.Tracing = d.tracing(m["tracing"])
	return cfg
}

func (d *decoder) tracing(v any) Tracing {
	t := Tracing{SampleRatio: DefaultSampleRatio}
	if v == nil {
		return t
	}
	m, ok := d.object("tracing", v, "otlp_endpoint", "sample_ratio")
	if !ok {
		return t
	}
	t.OTLPEndpoint = d.str("tracing", m, "otlp_endpoint", "")
	if t.OTLPEndpoint != "" {
		if u, err := url.Parse(t.OTLPEndpoint); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			d.fail("tracing.otlp_endpoint", "must be an http or https URL with a host, got %q", t.OTLPEndpoint)
		}
	}
	t.SampleRatio = d.float("tracing", m, "sample_ratio", DefaultSampleRatio, 0, 1)
	return t
}

func (d *decoder) metadataCenter(v any) MetadataCenter {
	mc := MetadataCenter{QueryTimeout: DefaultQueryTimeout, UpdateTimeout: DefaultUpdateTimeout}
	if v == nil {
		return mc
	}
	const p = "metadata_center"
	m, ok := d.object(p, v, "address", "query_timeout", "update_timeout", "auth_token", "auth_token_file", "tls")
	if !ok {
		return mc
	}
	mc.Address = strings.TrimRight(d.str(p, m, "address", ""), "/")
	if mc.Address != "" {
		if err := checkURL(mc.Address); err != nil {
			d.fail(p+".address", "%v", err)
		}
	}
	mc.QueryTimeout = d.duration(p, m, "query_timeout", DefaultQueryTimeout, time.Millisecond, 10*time.Second)
	mc.UpdateTimeout = d.duration(p, m, "update_timeout", DefaultUpdateTimeout, time.Millisecond, time.Minute)
	mc.AuthToken = d.str(p, m, "auth_token", "")
	if strings.ContainsAny(mc.AuthToken, "\r\n") {
		d.fail(p+".auth_token", "must not contain line breaks")
	}
	mc.AuthTokenFile = d.str(p, m, "auth_token_file", "")
	if mc.AuthToken != "" && mc.AuthTokenFile != "" {
		d.fail(p+".auth_token_file", "set auth_token or auth_token_file, not both")
	}
	if v, ok := m["tls"]; ok && v != nil {
		if tm, ok := d.object(p+".tls", v, "ca_file", "server_name", "insecure_skip_verify"); ok {
			mc.TLS = &MetadataCenterTLS{
				CAFile:             d.str(p+".tls", tm, "ca_file", ""),
				ServerName:         d.str(p+".tls", tm, "server_name", ""),
				InsecureSkipVerify: d.boolean(p+".tls", tm, "insecure_skip_verify", false),
			}
			if mc.TLS.InsecureSkipVerify && mc.TLS.CAFile != "" {
				d.fail(p+".tls.insecure_skip_verify", "skips the verification ca_file is for: set one")
			}
			if mc.Address != "" && !strings.HasPrefix(mc.Address, "https://") {
				d.fail(p+".tls", "needs an https:// address")
			}
		}
	}
	return mc
}

func (d *decoder) models(v any) map[string][]Rule {
	const p = "model_mapping_rule"
	if v == nil {
		d.fail(p, "is required: at least one model with its rules")
		return nil
	}
	m, ok := d.object(p, v)
	if !ok {
		return nil
	}
	if len(m) == 0 {
		d.fail(p, "must list at least one model")
	}
	out := make(map[string][]Rule, len(m))
	for _, model := range sortedKeys(m) {
		mp := join(p, model)
		if model == "" {
			d.fail(p, "empty model name")
			continue
		}
		list, ok := m[model].([]any)
		if !ok {
			d.fail(mp, "must be a list of rules, got %s", kind(m[model]))
			continue
		}
		if len(list) == 0 {
			d.fail(mp, "must have at least one rule")
			continue
		}
		seen := map[string]int{}
		var rules []Rule
		for i, rv := range list {
			rp := fmt.Sprintf("%s[%d]", mp, i)
			rm, ok := d.object(rp, rv, "headers", "cluster", "backend", "scene_name", "selector")
			if !ok {
				continue
			}
			r := Rule{
				Cluster:   d.str(rp, rm, "cluster", ""),
				Backend:   d.str(rp, rm, "backend", DefaultBackend),
				SceneName: d.str(rp, rm, "scene_name", ""),
			}
			if r.Cluster == "" {
				d.fail(join(rp, "cluster"), "is required")
			}
			if !slices.Contains(Backends(), r.Backend) {
				d.fail(join(rp, "backend"), "must be one of %s, got %q", strings.Join(Backends(), ", "), r.Backend)
			}
			if hv, ok := rm["headers"]; ok && hv != nil {
				hs := d.stringMap(join(rp, "headers"), hv)
				if len(hs) > 0 {
					r.Headers = make(map[string]string, len(hs))
					for k, val := range hs {
						lk := strings.ToLower(k)
						if _, dup := r.Headers[lk]; dup {
							d.fail(join(join(rp, "headers"), k), "duplicate header (names are case-insensitive)")
						}
						r.Headers[lk] = val
					}
				}
			}
			if sv, ok := rm["selector"]; ok && sv != nil {
				if sel := d.stringMap(join(rp, "selector"), sv); len(sel) > 0 {
					r.Selector = sel
				}
			}
			key := headerKey(r.Headers)
			if j, dup := seen[key]; dup {
				if key == "" {
					d.fail(rp, "second rule without headers (rule %d is already the default)", j)
				} else {
					d.fail(join(rp, "headers"), "same conditions as rule %d: this rule could never match", j)
				}
			}
			seen[key] = i
			rules = append(rules, r)
		}
		out[model] = rules
	}
	return out
}

func headerKey(h map[string]string) string {
	var b strings.Builder
	for _, k := range sortedKeys(h) {
		b.WriteString(strconv.Quote(k))
		b.WriteByte('=')
		b.WriteString(strconv.Quote(h[k]))
		b.WriteByte(';')
	}
	return b.String()
}

var lbKeys = []string{"policy", "cache_ratio_weight", "request_load_weight", "prefill_load_weight", "candidate_percent",
	"tie_epsilon", "default_prefill_rate", "default_decode_step", "scorers", "filters", "picker"}

// validName is the shape of policy, scorer, filter and picker names.
func validName(s string) bool {
	if s == "" || len(s) > 64 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

func (d *decoder) lbRule(path string, v any, base LBRule) LBRule {
	m, ok := d.object(path, v, lbKeys...)
	if !ok {
		return base
	}
	r := base
	r.Policy = d.str(path, m, "policy", base.Policy)
	if !validName(r.Policy) {
		d.fail(join(path, "policy"), "must be a policy name (lower-case letters, digits, _ or -; e.g. %s), got %q", strings.Join(Policies(), ", "), r.Policy)
	}
	if v, ok := m["scorers"]; ok && v != nil {
		sp := join(path, "scorers")
		if sm, ok := d.object(sp, v); ok {
			r.Scorers = map[string]float64{}
			for _, name := range sortedKeys(sm) {
				if !validName(name) {
					d.fail(sp, "invalid scorer name %q", name)
					continue
				}
				r.Scorers[name] = d.float(sp, sm, name, 0, 0, 1000)
			}
		}
	}
	if v, ok := m["filters"]; ok && v != nil {
		fp := join(path, "filters")
		list, ok := v.([]any)
		if !ok {
			d.fail(fp, "must be a list of filter names")
		}
		r.Filters = []string{}
		for _, e := range list {
			name, ok := e.(string)
			if !ok || !validName(name) {
				d.fail(fp, "invalid filter name %v", e)
				continue
			}
			r.Filters = append(r.Filters, name)
		}
	}
	r.Picker = d.str(path, m, "picker", base.Picker)
	if r.Picker != "" && !validName(r.Picker) {
		d.fail(join(path, "picker"), "must be a picker name (top_percent, max_score), got %q", r.Picker)
	}
	r.CacheRatioWeight = d.float(path, m, "cache_ratio_weight", base.CacheRatioWeight, 0, 1000)
	r.RequestLoadWeight = d.float(path, m, "request_load_weight", base.RequestLoadWeight, 0, 1000)
	r.PrefillLoadWeight = d.float(path, m, "prefill_load_weight", base.PrefillLoadWeight, 0, 1000)
	r.CandidatePercent = d.integer(path, m, "candidate_percent", base.CandidatePercent, 1, 100)
	// cache_aware's keys (filter/balancer/ttft.go). A tie window of a
	// whole prediction or more would make the choice random; prefill rates
	// and decode steps outside these bounds are no accelerator's.
	r.TieEpsilon = d.float(path, m, "tie_epsilon", base.TieEpsilon, 0, 1)
	r.DefaultPrefillRate = d.float(path, m, "default_prefill_rate", base.DefaultPrefillRate, 10, 1e7)
	r.DefaultDecodeStep = d.float(path, m, "default_decode_step", base.DefaultDecodeStep, 1e-4, 10)
	return r
}

func (d *decoder) lbMapping(v any) LBMapping {
	def := LBRule{
		Policy:             DefaultPolicy,
		CacheRatioWeight:   DefaultCacheRatioW,
		RequestLoadWeight:  DefaultRequestLoadW,
		PrefillLoadWeight:  DefaultPrefillLoadW,
		CandidatePercent:   DefaultCandidatePercent,
		TieEpsilon:         DefaultTieEpsilon,
		DefaultPrefillRate: DefaultPrefillRate,
		DefaultDecodeStep:  DefaultDecodeStep,
	}
	out := LBMapping{Default: def}
	if v == nil {
		return out
	}
	const p = "lb_mapping_rule"
	m, ok := d.object(p, v)
	if !ok {
		return out
	}
	if dv, ok := m["default"]; ok && dv != nil {
		out.Default = d.lbRule(join(p, "default"), dv, def)
	}
	for _, cluster := range sortedKeys(m) {
		if cluster == "default" {
			continue
		}
		if cluster == "" {
			d.fail(p, "empty cluster name")
			continue
		}
		if out.Clusters == nil {
			out.Clusters = map[string]LBRule{}
		}
		out.Clusters[cluster] = d.lbRule(join(p, cluster), m[cluster], out.Default)
	}
	return out
}

func (d *decoder) endpoints(v any) Endpoints {
	var out Endpoints
	if v == nil {
		return out
	}
	const p = "endpoints"
	m, ok := d.object(p, v, "envoy_admin", "static")
	if !ok {
		return out
	}
	if av, ok := m["envoy_admin"]; ok && av != nil {
		ap := p + ".envoy_admin"
		if am, ok := d.object(ap, av, "address", "refresh"); ok {
			ea := &EnvoyAdmin{Address: strings.TrimRight(d.str(ap, am, "address", ""), "/")}
			if ea.Address == "" {
				d.fail(ap+".address", "is required")
			} else if err := checkURL(ea.Address); err != nil {
				d.fail(ap+".address", "%v", err)
			}
			ea.Refresh = d.duration(ap, am, "refresh", DefaultAdminRefresh, 10*time.Millisecond, 10*time.Minute)
			out.EnvoyAdmin = ea
		}
	}
	if sv, ok := m["static"]; ok && sv != nil {
		sp := p + ".static"
		if sm, ok := d.object(sp, sv); ok {
			out.Static = make(map[string][]string, len(sm))
			for _, cluster := range sortedKeys(sm) {
				cp := join(sp, cluster)
				if cluster == "" {
					d.fail(sp, "empty cluster name")
					continue
				}
				list, ok := sm[cluster].([]any)
				if !ok {
					d.fail(cp, "must be a list of \"ip:port\", got %s", kind(sm[cluster]))
					continue
				}
				addrs := make([]string, 0, len(list))
				for i, av := range list {
					ep := fmt.Sprintf("%s[%d]", cp, i)
					s, labels, ok := d.staticEntry(ep, av)
					if !ok {
						continue
					}
					norm, err := endpoints.NormalizeAddress(s)
					if err != nil {
						d.fail(ep, "%v", err)
						continue
					}
					addrs = append(addrs, norm)
					if len(labels) > 0 {
						if out.StaticLabels == nil {
							out.StaticLabels = map[string]map[string]map[string]string{}
						}
						if out.StaticLabels[cluster] == nil {
							out.StaticLabels[cluster] = map[string]map[string]string{}
						}
						out.StaticLabels[cluster][norm] = labels
					}
				}
				out.Static[cluster] = addrs
			}
		}
	}
	return out
}

// staticEntry reads one static endpoint: "ip:port", or
// {address: "ip:port", labels: {k: v}} for label selectors.
func (d *decoder) staticEntry(ep string, v any) (string, map[string]string, bool) {
	switch e := v.(type) {
	case string:
		return e, nil, true
	case map[string]any:
		m, ok := d.object(ep, e, "address", "labels")
		if !ok {
			return "", nil, false
		}
		addr := d.str(ep, m, "address", "")
		if addr == "" {
			d.fail(ep+".address", "is required")
			return "", nil, false
		}
		var labels map[string]string
		if lv, ok := m["labels"]; ok && lv != nil {
			labels = d.stringMap(ep+".labels", lv)
		}
		return addr, labels, true
	}
	d.fail(ep, "must be an \"ip:port\" string or {address, labels}, got %s", kind(v))
	return "", nil, false
}

func (d *decoder) async(v any) Async {
	a := Async{QueueSize: DefaultQueueSize, Workers: DefaultWorkers, DrainTimeout: DefaultDrainTimeout,
		BatchWindow: DefaultBatchWindow, BatchMaxOps: DefaultBatchMaxOps}
	if v == nil {
		return a
	}
	const p = "async"
	m, ok := d.object(p, v, "queue_size", "workers", "drain_timeout", "batch_window", "batch_max_ops")
	if !ok {
		return a
	}
	a.QueueSize = d.integer(p, m, "queue_size", DefaultQueueSize, 1, 1<<20)
	a.Workers = d.integer(p, m, "workers", DefaultWorkers, 1, 1024)
	a.DrainTimeout = d.duration(p, m, "drain_timeout", DefaultDrainTimeout, 0, time.Minute)
	a.BatchWindow = d.duration(p, m, "batch_window", DefaultBatchWindow, 0, time.Second)
	a.BatchMaxOps = d.integer(p, m, "batch_max_ops", DefaultBatchMaxOps, 1, 1024)
	if a.Workers > a.QueueSize {
		d.fail(p+".workers", "must not exceed async.queue_size (%d), got %d", a.QueueSize, a.Workers)
	}
	return a
}
