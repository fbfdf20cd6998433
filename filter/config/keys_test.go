package config

import (
	"encoding/json"
	"fmt"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// allowedKeys reads the keys the parser allows at each object level off the
// error it gives for an unknown one, and returns every key path in Keys'
// notation: the parser, not the table, says which keys exist.
func allowedKeys(t *testing.T) []string {
	t.Helper()
	levels := map[string]string{ // object level -> its path to probe at
		"":                              "",
		"metadata_center":               "metadata_center",
		"metadata_center.tls":           "metadata_center.tls",
		"prompt_hash":                   "prompt_hash",
		"model_mapping_rule.<model>[i]": "model_mapping_rule.<model>[i]",
		"lb_mapping_rule.<cluster>":     "lb_mapping_rule.<cluster>",
		"endpoints":                     "endpoints",
		"endpoints.envoy_admin":         "endpoints.envoy_admin",
		"endpoints.static.<cluster>[i]": "endpoints.static.<cluster>[i]",
		"async":                         "async",
		"tracing":                       "tracing",
	}
	allowedRE := regexp.MustCompile(`zz_unknown: unknown key \(allowed: ([a-z_, ]+)\)`)
	var paths []string
	for level, at := range levels {
		doc := docWith(t, join(at, "zz_unknown"), 1)
		_, err := FromValue(doc)
		m := allowedRE.FindStringSubmatch(fmt.Sprint(err))
		if m == nil {
			t.Fatalf("%s: cannot read the allowed keys from %v", level, err)
		}
		for _, k := range strings.Split(m[1], ", ") {
			p := join(level, k)
			switch p {
			case "metadata_center", "prompt_hash", "endpoints", "async", "endpoints.envoy_admin", "metadata_center.tls", "tracing":
				continue // object levels probed above
			case "model_mapping_rule", "lb_mapping_rule", "endpoints.static":
				continue // maps of models and clusters, probed above
			}
			paths = append(paths, p)
		}
	}
	// A static entry is also a key of its own: "ip:port" or the object.
	paths = append(paths, "endpoints.static.<cluster>[i]")
	slices.Sort(paths)
	return paths
}

// omit as docWith's value leaves the key out, keeping the objects above it.
var omit any = new(struct{ omitted bool })

// docWith returns the smallest document the parser accepts, with value set
// at path (in Keys' notation).
func docWith(t *testing.T, path string, value any) map[string]any {
	t.Helper()
	doc := map[string]any{"model_mapping_rule": map[string]any{"m": []any{map[string]any{"cluster": "c"}}}}
	switch {
	case strings.HasPrefix(path, "endpoints.envoy_admin.") && path != "endpoints.envoy_admin.address":
		doc["endpoints"] = map[string]any{"envoy_admin": map[string]any{"address": "http://127.0.0.1:15000"}}
	case path == "async.queue_size":
		doc["async"] = map[string]any{"workers": 1} // workers ≤ queue_size
	}
	cur := doc
	segs := strings.Split(path, ".")
	for i, seg := range segs {
		last := i == len(segs)-1
		name, list := strings.CutSuffix(seg, "[i]")
		switch name {
		case "<model>":
			name = "m"
		case "<cluster>":
			name = "default"
			if segs[i-1] == "static" {
				name = "c"
			}
		}
		if list {
			l, _ := cur[name].([]any)
			if len(l) == 0 {
				entry := map[string]any{}
				if segs[i-1] == "static" && !(i+1 < len(segs) && segs[i+1] == "address") {
					entry["address"] = "10.0.0.1:8000"
				}
				l = []any{entry}
				cur[name] = l
			}
			if last {
				l[0] = value
				break
			}
			cur = l[0].(map[string]any)
			continue
		}
		if last {
			cur[name] = value
			if value == omit {
				delete(cur, name)
			}
			break
		}
		next, ok := cur[name].(map[string]any)
		if !ok {
			next = map[string]any{}
			cur[name] = next
		}
		cur = next
	}
	// A JSON round trip gives the parser the kinds a YAML document would.
	b, err := json.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	var out map[string]any
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	return out
}

func TestKeysMatchTheParser(t *testing.T) {
	var table []string
	for _, k := range Keys {
		if k.Path == "" || k.Type == "" || k.Range == "" || k.Meaning == "" {
			t.Errorf("incomplete row %+v", k)
		}
		table = append(table, k.Path)
	}
	slices.Sort(table)
	if want := allowedKeys(t); !slices.Equal(table, want) {
		t.Errorf("config.Keys lists\n%v\nthe parser allows\n%v", table, want)
	}
}

// typed reads a value written as in the document into the kind the
// document's decoder hands the parser.
func typed(t *testing.T, k Key, s string) any {
	t.Helper()
	switch k.Type {
	case "boolean":
		b, err := strconv.ParseBool(s)
		if err != nil {
			t.Fatalf("%s: %q is not a boolean: %v", k.Path, s, err)
		}
		return b
	case "integer", "number":
		f, err := strconv.ParseFloat(s, 64)
		if err != nil {
			t.Fatalf("%s: %q is not a number: %v", k.Path, s, err)
		}
		return f
	}
	return s
}

func parseWith(t *testing.T, path string, value any) (*Config, error) {
	t.Helper()
	return FromValue(docWith(t, path, value))
}

// A row's default is what the parser fills in: the document with the key
// set to it parses to the same configuration as the document without it.
func TestKeyDefaultsAreTheParsers(t *testing.T) {
	for _, k := range Keys {
		if k.Default == "" {
			continue
		}
		t.Run(k.Path, func(t *testing.T) {
			without, err := parseWith(t, k.Path, omit)
			if err != nil {
				t.Fatal(err)
			}
			with, err := parseWith(t, k.Path, typed(t, k, k.Default))
			if err != nil {
				t.Fatalf("the default %q is refused: %v", k.Default, err)
			}
			if !reflect.DeepEqual(with, without) {
				t.Errorf("%s: %q is not the parser's default:\nwith    %+v\nwithout %+v", k.Path, k.Default, with, without)
			}
		})
	}
}

var rangeRE = regexp.MustCompile(`^(0 or )?([0-9.]+[a-zµ]*)\.\.([0-9.]+[a-zµ]*)\b`)

// A row's range is the parser's: both ends accepted, just past them refused
// with an error naming the key.
func TestKeyRangesAreTheParsers(t *testing.T) {
	checked := 0
	for _, k := range Keys {
		if k.Type != "integer" && k.Type != "number" && k.Type != "duration" {
			continue
		}
		m := rangeRE.FindStringSubmatch(k.Range)
		if m == nil {
			t.Errorf("%s: range %q does not read as lo..hi", k.Path, k.Range)
			continue
		}
		checked++
		t.Run(k.Path, func(t *testing.T) {
			leaf := k.Path[strings.LastIndex(k.Path, ".")+1:]
			var ok, bad []any
			switch k.Type {
			case "duration":
				lo, err1 := time.ParseDuration(m[2])
				hi, err2 := time.ParseDuration(m[3])
				if err1 != nil || err2 != nil {
					t.Fatalf("range %q: %v %v", k.Range, err1, err2)
				}
				ok = []any{lo.String(), hi.String()}
				bad = []any{(lo - time.Nanosecond).String(), (hi + time.Nanosecond).String()}
			default:
				lo, err1 := strconv.ParseFloat(m[2], 64)
				hi, err2 := strconv.ParseFloat(m[3], 64)
				if err1 != nil || err2 != nil {
					t.Fatalf("range %q: %v %v", k.Range, err1, err2)
				}
				below := lo - 1
				if k.Type == "number" && lo > 0 {
					below = lo / 2
				}
				ok, bad = []any{lo, hi}, []any{below, hi + 1}
			}
			if m[1] != "" {
				ok = append(ok, 0.0)
			}
			for _, v := range ok {
				if _, err := parseWith(t, k.Path, v); err != nil {
					t.Errorf("%v is in range %q but refused: %v", v, k.Range, err)
				}
			}
			for _, v := range bad {
				_, err := parseWith(t, k.Path, v)
				if err == nil || !strings.Contains(err.Error(), leaf) {
					t.Errorf("%v is outside range %q but the parser said %v", v, k.Range, err)
				}
			}
		})
	}
	if checked < 17 { // every integer, number and duration key
		t.Errorf("only %d ranges checked", checked)
	}
}
