package main

import (
	_ "istio.io/client-go/pkg/apis/networking/v1alpha3"
	_ "k8s.io/api/apps/v1"
	_ "k8s.io/api/core/v1"
	_ "k8s.io/api/policy/v1"
	_ "k8s.io/apimachinery/pkg/util/yaml"
	_ "sigs.k8s.io/kustomize/api/krusty"
)
