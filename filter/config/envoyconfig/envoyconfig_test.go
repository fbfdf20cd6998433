package envoyconfig

import (
	"strings"
	"testing"
	"time"

	xdstype "github.com/cncf/xds/go/xds/type/v3"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

func TestParseAnyTypedStruct(t *testing.T) {
	v, err := structpb.NewStruct(map[string]any{
		"protocol":           "triton",
		"metadata_center":    map[string]any{"address": "http://mc:8080/", "query_timeout": "50ms", "auth_token": "s3"},
		"model_mapping_rule": map[string]any{"m": []any{map[string]any{"cluster": "c", "backend": "triton"}}},
		"lb_mapping_rule":    map[string]any{"default": map[string]any{"candidate_percent": 30.0}},
		"async":              map[string]any{"queue_size": 16.0, "workers": 2.0},
	})
	if err != nil {
		t.Fatal(err)
	}
	a, err := anypb.New(&xdstype.TypedStruct{TypeUrl: "type.googleapis.com/llm.filter", Value: v})
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := Parse(a)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Protocol != "triton" || cfg.MetadataCenter.Address != "http://mc:8080" || cfg.MetadataCenter.QueryTimeout != 50*time.Millisecond ||
		cfg.MetadataCenter.AuthToken != "s3" || cfg.LBMappingRule.Default.CandidatePercent != 30 || cfg.Async.Workers != 2 ||
		cfg.ModelMappingRule["m"][0].Backend != "triton" {
		t.Fatalf("parsed: %+v", cfg)
	}

	// A plain Struct is accepted too.
	sa, _ := anypb.New(v)
	if _, err := Parse(sa); err != nil {
		t.Fatal(err)
	}
	// Invalid values inside the TypedStruct still name their key.
	bad, _ := structpb.NewStruct(map[string]any{"model_mapping_rule": map[string]any{"m": []any{map[string]any{"cluster": "c"}}},
		"prompt_hash": map[string]any{"chunk_size": 0.5}})
	ba, _ := anypb.New(&xdstype.TypedStruct{Value: bad})
	if _, err := Parse(ba); err == nil || !strings.Contains(err.Error(), "prompt_hash.chunk_size: must be an integer") {
		t.Fatalf("got %v", err)
	}
	// Anything else is refused.
	wa, _ := anypb.New(wrapperspb.String("x"))
	if _, err := Parse(wa); err == nil || !strings.Contains(err.Error(), "want xds.type.v3.TypedStruct") {
		t.Fatalf("got %v", err)
	}
	if _, err := Parse(nil); err == nil {
		t.Fatal("nil accepted")
	}
}
