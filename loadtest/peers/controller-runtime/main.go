// Command controller-runtime-peer is the ApplicationTrafficPolicy reconcile written the way
// a controller-runtime user would write it: GenerationChangedPredicate on the policy,
// Owns for the children, CreateOrUpdate for each child, and a status update. The load test
// runs it against the same control plane and policies as the operator, for comparison.
//
// With -tuned it is written as a skilled user would tune it for many objects: -workers
// concurrent reconciles, managed fields stripped from the cache, children watched as
// metadata only, and children written by server-side apply. The last follows from the one
// before: a Get of a full child through the cached client would start the full informer
// that OnlyMetadata avoids.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/intstr"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"
	metav1ac "k8s.io/client-go/applyconfigurations/meta/v1"
	networkingv1ac "k8s.io/client-go/applyconfigurations/networking/v1"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
)

var groupVersion = schema.GroupVersion{Group: "trafficpolicy.dev", Version: "v1"}

type IPBlock struct {
	CIDR   string   `json:"cidr"`
	Except []string `json:"except,omitempty"`
}

type Peer struct {
	IPBlock IPBlock `json:"ipBlock"`
}

type Port struct {
	Protocol string `json:"protocol,omitempty"`
	Port     int32  `json:"port"`
}

type Rule struct {
	From  []Peer `json:"from,omitempty"`
	To    []Peer `json:"to,omitempty"`
	Ports []Port `json:"ports,omitempty"`
}

type RateLimit struct {
	RequestsPerSecond int32 `json:"requestsPerSecond"`
	Burst             int32 `json:"burst,omitempty"`
}

type Spec struct {
	ApplicationSelector struct {
		MatchLabels map[string]string `json:"matchLabels"`
	} `json:"applicationSelector"`
	IngressRules []Rule     `json:"ingressRules,omitempty"`
	EgressRules  []Rule     `json:"egressRules,omitempty"`
	RateLimit    *RateLimit `json:"rateLimit,omitempty"`
}

type Status struct {
	ObservedGeneration int64              `json:"observedGeneration,omitempty"`
	Conditions         []metav1.Condition `json:"conditions,omitempty"`
}

type ApplicationTrafficPolicy struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              Spec   `json:"spec"`
	Status            Status `json:"status,omitempty"`
}

type ApplicationTrafficPolicyList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []ApplicationTrafficPolicy `json:"items"`
}

// DeepCopyObject by a JSON round trip: there is no code generator in this small peer.
func (p *ApplicationTrafficPolicy) DeepCopyObject() runtime.Object {
	out := &ApplicationTrafficPolicy{}
	copyJSON(p, out)
	return out
}

func (l *ApplicationTrafficPolicyList) DeepCopyObject() runtime.Object {
	out := &ApplicationTrafficPolicyList{}
	copyJSON(l, out)
	return out
}

func copyJSON(from, to any) {
	data, err := json.Marshal(from)
	if err != nil {
		panic(err)
	}
	if err := json.Unmarshal(data, to); err != nil {
		panic(err)
	}
}

type reconciler struct {
	client.Client
	scheme *runtime.Scheme
	// Children by server-side apply, without reading them (-tuned).
	apply bool
}

func (r *reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	var policy ApplicationTrafficPolicy
	if err := r.Get(ctx, req.NamespacedName, &policy); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	write := r.createOrUpdate
	if r.apply {
		write = r.applyChildren
	}
	if err := write(ctx, &policy); err != nil {
		return ctrl.Result{}, err
	}
	policy.Status.ObservedGeneration = policy.Generation
	apimeta.SetStatusCondition(&policy.Status.Conditions, metav1.Condition{
		Type: "Ready", Status: metav1.ConditionTrue, Reason: "Applied", ObservedGeneration: policy.Generation,
		Message: "NetworkPolicy and rate-limit ConfigMap are in place",
	})
	return ctrl.Result{}, r.Status().Update(ctx, &policy)
}

func rateLimitDocument(policy *ApplicationTrafficPolicy) (string, error) {
	doc, err := json.Marshal(map[string]any{
		"version": 1, "policy": policy.Namespace + "/" + policy.Name,
		"podSelector": policy.Spec.ApplicationSelector.MatchLabels, "rateLimit": policy.Spec.RateLimit,
	})
	return string(doc), err
}

func (r *reconciler) createOrUpdate(ctx context.Context, policy *ApplicationTrafficPolicy) error {
	np := &networkingv1.NetworkPolicy{ObjectMeta: metav1.ObjectMeta{Name: policy.Name, Namespace: policy.Namespace}}
	if _, err := controllerutil.CreateOrUpdate(ctx, r.Client, np, func() error {
		np.Spec = networkPolicySpec(&policy.Spec)
		return controllerutil.SetControllerReference(policy, np, r.scheme)
	}); err != nil {
		return err
	}
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: policy.Name, Namespace: policy.Namespace}}
	_, err := controllerutil.CreateOrUpdate(ctx, r.Client, cm, func() error {
		doc, err := rateLimitDocument(policy)
		if err != nil {
			return err
		}
		cm.Data = map[string]string{"ratelimit.json": doc}
		return controllerutil.SetControllerReference(policy, cm, r.scheme)
	})
	return err
}

func (r *reconciler) applyChildren(ctx context.Context, policy *ApplicationTrafficPolicy) error {
	owner := metav1ac.OwnerReference().WithAPIVersion(groupVersion.String()).WithKind("ApplicationTrafficPolicy").
		WithName(policy.Name).WithUID(policy.UID).WithController(true).WithBlockOwnerDeletion(true)
	// The typed spec through JSON into its apply configuration: the same fields, built once.
	spec := &networkingv1ac.NetworkPolicySpecApplyConfiguration{}
	copyJSON(networkPolicySpec(&policy.Spec), spec)
	np := networkingv1ac.NetworkPolicy(policy.Name, policy.Namespace).WithOwnerReferences(owner).WithSpec(spec)
	if err := r.Apply(ctx, np, client.FieldOwner("controller-runtime-peer"), client.ForceOwnership); err != nil {
		return err
	}
	doc, err := rateLimitDocument(policy)
	if err != nil {
		return err
	}
	cm := corev1ac.ConfigMap(policy.Name, policy.Namespace).WithOwnerReferences(owner).
		WithData(map[string]string{"ratelimit.json": doc})
	return r.Apply(ctx, cm, client.FieldOwner("controller-runtime-peer"), client.ForceOwnership)
}

func networkPolicySpec(spec *Spec) networkingv1.NetworkPolicySpec {
	peers := func(in []Peer) (out []networkingv1.NetworkPolicyPeer) {
		for _, p := range in {
			out = append(out, networkingv1.NetworkPolicyPeer{IPBlock: &networkingv1.IPBlock{CIDR: p.IPBlock.CIDR, Except: p.IPBlock.Except}})
		}
		return out
	}
	ports := func(in []Port) (out []networkingv1.NetworkPolicyPort) {
		for _, p := range in {
			protocol := corev1.Protocol(p.Protocol)
			if p.Protocol == "" || p.Protocol == "HTTP" {
				protocol = corev1.ProtocolTCP
			}
			port := intstr.FromInt32(p.Port)
			out = append(out, networkingv1.NetworkPolicyPort{Protocol: &protocol, Port: &port})
		}
		return out
	}
	result := networkingv1.NetworkPolicySpec{
		PodSelector: metav1.LabelSelector{MatchLabels: spec.ApplicationSelector.MatchLabels},
		PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress, networkingv1.PolicyTypeEgress},
	}
	for _, rule := range spec.IngressRules {
		result.Ingress = append(result.Ingress, networkingv1.NetworkPolicyIngressRule{From: peers(rule.From), Ports: ports(rule.Ports)})
	}
	for _, rule := range spec.EgressRules {
		result.Egress = append(result.Egress, networkingv1.NetworkPolicyEgressRule{To: peers(rule.To), Ports: ports(rule.Ports)})
	}
	return result
}

func main() {
	tuned := flag.Bool("tuned", false, "tune for many objects (see the package comment)")
	workers := flag.Int("workers", 32, "concurrent reconciles with -tuned")
	flag.Parse() // and --kubeconfig, registered by controller-runtime
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		panic(err)
	}
	scheme.AddKnownTypes(groupVersion, &ApplicationTrafficPolicy{}, &ApplicationTrafficPolicyList{})
	metav1.AddToGroupVersion(scheme, groupVersion)

	options := ctrl.Options{
		Scheme:                 scheme,
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
	}
	concurrency := 1
	var children []builder.OwnsOption
	if *tuned {
		options.Cache = cache.Options{DefaultTransform: cache.TransformStripManagedFields()}
		concurrency = *workers
		children = append(children, builder.OnlyMetadata)
	}
	mgr, err := ctrl.NewManager(ctrl.GetConfigOrDie(), options)
	if err != nil {
		fmt.Fprintln(os.Stderr, "controller-runtime-peer:", err)
		os.Exit(1)
	}
	err = ctrl.NewControllerManagedBy(mgr).
		For(&ApplicationTrafficPolicy{}, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		Owns(&networkingv1.NetworkPolicy{}, children...).
		Owns(&corev1.ConfigMap{}, children...).
		WithOptions(controller.Options{MaxConcurrentReconciles: concurrency}).
		Complete(&reconciler{Client: mgr.GetClient(), scheme: scheme, apply: *tuned})
	if err != nil {
		fmt.Fprintln(os.Stderr, "controller-runtime-peer:", err)
		os.Exit(1)
	}
	if err := mgr.Start(ctrl.SetupSignalHandler()); err != nil {
		fmt.Fprintln(os.Stderr, "controller-runtime-peer:", err)
		os.Exit(1)
	}
}
