//go:build envoy

package main

/*
#cgo linux LDFLAGS: -Wl,-unresolved-symbols=ignore-all
#include <stdint.h>
// Envoy's C API (contrib/golang/common/go/api/api.h); CAPIStatus is an enum.
int envoyGoFilterHttpDefineMetric(void* c, uint32_t metric_type, void* name_data, int name_len, uint32_t* metric_id);
int envoyGoFilterHttpRecordMetric(void* c, uint32_t metric_id, uint64_t value);
*/
import "C"

import (
	"reflect"
	"unsafe"

	"github.com/envoyproxy/envoy/contrib/golang/common/go/api"
)

const capiOK = 0

// defineHistogram defines an Envoy histogram through the C API the Go SDK
// does not wrap yet (api.ConfigCallbacks has no DefineHistogramMetric in
// v1.36; FilterConfig::defineMetric and recordMetric in golang_filter.cc
// handle MetricType::Histogram). The C config pointer is the only field of
// the SDK's *httpConfig; anything else (another SDK version) defines
// nothing rather than guess.
func defineHistogram(cb api.ConfigCallbackHandler, name string) (func(uint64), bool) {
	v := reflect.ValueOf(cb)
	if v.Kind() != reflect.Pointer || v.IsNil() || v.Elem().Kind() != reflect.Struct {
		return nil, false
	}
	s := v.Elem()
	if s.NumField() != 1 || s.Type().Field(0).Name != "config" || s.Field(0).Kind() != reflect.Pointer {
		return nil, false
	}
	cfg := unsafe.Pointer(s.Field(0).Pointer())
	if cfg == nil {
		return nil, false
	}
	var id C.uint32_t
	if C.envoyGoFilterHttpDefineMetric(cfg, C.uint32_t(api.Histogram), unsafe.Pointer(unsafe.StringData(name)), C.int(len(name)), &id) != capiOK {
		return nil, false
	}
	// The closure keeps cb, and with it the C config, alive; once Envoy
	// destroys the config the call returns an error status, ignored.
	return func(value uint64) {
		_ = cb
		C.envoyGoFilterHttpRecordMetric(cfg, id, C.uint64_t(value))
	}, true
}
