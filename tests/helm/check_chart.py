#!/usr/bin/env python3
"""Checks the hcp-sense Helm chart (helm/hcp-sense) offline, with Helm's own library.

1. Lints the chart (strict, Kubernetes 1.37) with the default values and with
   values-production.yaml.
2. Renders it (release "sense", namespace "hcp") as an install and as an upgrade, with the default
   values, the production values and a few variants, parses every document and validates every
   object with kubernetes-validate (strict, 1.37). kubernetes-validate has no schema for the
   ServiceMonitor CRD (it raises SchemaNotFoundError), so that object is validated against the
   minimal schema below instead; no other object may lack a schema.
3. Asserts what matters for running hcp-sense: probes, security context, Secrets, the migration
   hook, the Service, the ingress listener (its port, Services and NetworkPolicy rule, on and
   off), the MCP door and the JSON door with its console (config keys, ports, Service ports and
   NetworkPolicy rules, on and off, and beside TLS), NATS (its URL only from a Secret), autoscaling, disruption budget, monitoring, network
   policy, the dashboard, shutdown timing and a config.toml that the binary accepts
   (`hcp-sense check-config` judges each rendering with the binary's own parsers, so the check
   follows the code).
4. Checks that bad values are refused: by values.schema.json, and by the chart's own checks.

Usage: check_chart.py [--emit-config DIR] [--binary PATH]
  --emit-config DIR  also write the production-rendered config.toml to DIR/config.toml, the
                     default-rendered one to DIR/config-default.toml, and the one rendered with
                     the ingress listener and NATS to DIR/config-ingress.toml with, in
                     DIR/nats-env, the variable the Deployment takes the NATS URL in (for a
                     test that starts the real binary with them).
  --binary PATH      the hcp-sense binary (default: target/debug/hcp-sense)

Needs Python 3.11+, helm-python-sdk, kubernetes-validate and PyYAML (jsonschema comes with
kubernetes-validate). Exits 1 with every failure listed, 0 with a short summary.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any, Callable, Iterator

try:
    import helm_python as helm
    import jsonschema
    import kubernetes_validate
    import yaml
except ImportError as e:  # pragma: no cover - environment problem, not a chart problem
    sys.exit(
        f"check_chart.py: missing Python package ({e}); "
        "pip install helm-python-sdk kubernetes-validate PyYAML"
    )

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CHART = REPO / "helm" / "hcp-sense"
PRODUCTION_VALUES = CHART / "values-production.yaml"
DASHBOARD = CHART / "dashboards" / "hcp-sense.json"
CONFIG_RS = REPO / "src" / "config.rs"
CARGO_TOML = REPO / "Cargo.toml"

KUBE_VERSION = "1.37.0"
RELEASE = "sense"
NAMESPACE = "hcp"
GRPC_PORT = 50051
METRICS_PORT = 9464
INGRESS_PORT = 8080
MCP_PORT = 8090
HTTP_PORT = 8091
NATS_ENV = "HCP_SENSE_NATS_URL"
RUN_AS = 65532
AUTH_MESSAGE = "no authentication configured"

# kubernetes-validate ships schemas for the built-in API groups only. For the Prometheus
# Operator's ServiceMonitor it raises SchemaNotFoundError, so the chart's ServiceMonitor is
# checked against this schema of the fields the chart uses (names and types as in the
# monitoring.coreos.com/v1 CRD), strict like the built-in ones.
DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 253},
                "namespace": {"type": "string"},
                "labels": STRING_MAP,
                "annotations": STRING_MAP,
            },
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": STRING_MAP},
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                            "interval": DURATION,
                            "scrapeTimeout": DURATION,
                        },
                    },
                },
            },
        },
    },
}

STANDARD_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
)


class Report:
    """Collects failures so that one run lists all of them."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.checks = 0
        self.objects_validated = 0
        self.scenarios: list[str] = []

    def check(self, ok: Any, message: str) -> bool:
        self.checks += 1
        if not ok:
            self.failures.append(message)
        return bool(ok)

    def fail(self, message: str) -> None:
        self.check(False, message)


# ---------------------------------------------------------------------------------------------
# Reading the code's interface


def crate_version() -> str:
    cargo = tomllib.loads(CARGO_TOML.read_text())
    version = cargo.get("package", {}).get("version")
    if isinstance(version, dict) or version is None:
        version = cargo["workspace"]["package"]["version"]
    return str(version)


def binary_accepts(binary: Path, toml_text: str) -> tuple[bool, str]:
    """Whether `hcp-sense check-config` accepts this config.toml: the binary's own parser of
    each key, not a copy of its rules. The environment's HCP_SENSE_* variables are left out."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.toml"
        path.write_text(toml_text)
        env = {k: v for k, v in os.environ.items() if not k.startswith("HCP_SENSE_") and k != "DATABASE_URL"}
        o = subprocess.run([str(binary), "check-config", "--config", str(path)], capture_output=True, text=True, env=env)
        return o.returncode == 0, (o.stdout + o.stderr).strip()


# ---------------------------------------------------------------------------------------------
# Helm


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """Captures what the Go library writes to file descriptor 2 (Helm's log lines)."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines.extend(tmp.read().decode(errors="replace").splitlines())


def lint(report: Report, label: str, values: dict[str, Any]) -> None:
    with captured_stderr() as log:
        result = helm.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}")
    severities = {0: "unknown", 1: "info", 2: "warning", 3: "error"}
    # Every message fails, info included: the chart answers them (e.g. an icon) rather than
    # leaving them for the next reader to wonder about.
    for msg in result.get("messages", []):
        report.fail(
            f"lint ({label}): [{severities.get(msg.get('severity'), msg.get('severity'))}] "
            f"{msg.get('path')}: {msg.get('error')}"
        )
    for err in result.get("errors", []):
        report.fail(f"lint ({label}): {err}")
    report.check(result.get("total_charts_linted") == 1, f"lint ({label}): linted {result.get('total_charts_linted')} charts, expected 1")
    # Helm lints in "lint mode", where the template function `fail` only logs (to file
    # descriptor 2) and rendering goes on: catch those, and any warning or error logged.
    seen: set[str] = set()
    for line in log:
        line = re.sub(r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ", "", line.strip())
        if ("funcMap fail" in line or re.search(r"\b(WARN|ERROR)\b", line)) and line not in seen:
            seen.add(line)
            report.fail(f"lint ({label}): the chart's own check failed: {line}" if "funcMap fail" in line else f"lint ({label}): {line}")


def render(values: dict[str, Any], *, upgrade: bool = False) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        with captured_stderr():
            return chart.render(
                values,
                name=RELEASE,
                namespace=NAMESPACE,
                is_install=not upgrade,
                is_upgrade=upgrade,
            )


def render_error(values: dict[str, Any]) -> str | None:
    try:
        render(values)
    except helm.HelmError as e:
        return str(e)
    return None


def schema_error(values: dict[str, Any]) -> str | None:
    with helm.Chart.load(CHART) as chart:
        try:
            chart.validate_schema(values)
        except helm.HelmError as e:
            return str(e)
    return None


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


# ---------------------------------------------------------------------------------------------
# Rendered objects


class Rendered:
    def __init__(self, report: Report, label: str, manifests: dict[str, str]) -> None:
        self.label = label
        self.sources = manifests
        self.objects: list[dict[str, Any]] = []
        self.notes = ""
        for path, text in sorted(manifests.items()):
            if path.endswith("NOTES.txt"):
                self.notes = text
                continue
            try:
                docs = [d for d in yaml.safe_load_all(text) if d is not None]
            except yaml.YAMLError as e:
                report.fail(f"{label}: {path} is not valid YAML: {e}")
                continue
            for doc in docs:
                if not isinstance(doc, dict) or "kind" not in doc:
                    report.fail(f"{label}: {path} has a document that is not a Kubernetes object")
                    continue
                doc["__template"] = path
                self.objects.append(doc)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, report: Report, kind: str, name_suffix: str | None = None) -> dict[str, Any] | None:
        found = [
            o
            for o in self.of_kind(kind)
            if name_suffix is None or o["metadata"]["name"].endswith(name_suffix)
        ]
        what = kind + (f" *{name_suffix}" if name_suffix else "")
        if not report.check(len(found) == 1, f"{self.label}: expected one {what}, found {len(found)}"):
            return None
        return found[0]


def strip(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k != "__template"}


def validate_objects(report: Report, r: Rendered) -> None:
    seen: set[tuple[str, str]] = set()
    for obj in r.objects:
        kind, name = obj["kind"], obj.get("metadata", {}).get("name", "?")
        where = f"{r.label}: {kind} {name} ({obj['__template']})"
        report.check((kind, name) not in seen, f"{where}: duplicate {kind} name")
        # Names become DNS labels (Services) and label values (a Job's name labels its pods).
        report.check(re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", name), f"{where}: name {name!r} is not a DNS label of at most 63 characters")
        seen.add((kind, name))
        body = strip(obj)
        try:
            kubernetes_validate.validate(body, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            report.fail(f"{where}: invalid for Kubernetes {KUBE_VERSION}: {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            if kind == "ServiceMonitor":
                errors = sorted(
                    jsonschema.Draft7Validator(SERVICE_MONITOR_SCHEMA).iter_errors(body),
                    key=lambda x: [str(p) for p in x.path],
                )
                for err in errors:
                    report.fail(f"{where}: {'.'.join(str(p) for p in err.path)}: {err.message}")
            else:
                report.fail(f"{where}: kubernetes-validate has no schema: {e.message}")
        report.objects_validated += 1
        meta = obj.get("metadata", {})
        labels = meta.get("labels") or {}
        for label in STANDARD_LABELS:
            report.check(label in labels, f"{where}: missing label {label}")
        report.check(labels.get("app.kubernetes.io/instance") == RELEASE, f"{where}: app.kubernetes.io/instance is not {RELEASE}")
        report.check(meta.get("namespace") == NAMESPACE, f"{where}: namespace is {meta.get('namespace')!r}, expected {NAMESPACE}")


# ---------------------------------------------------------------------------------------------
# Assertions


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def hook_set(obj: dict[str, Any]) -> tuple[set[str], int | None, set[str]]:
    ann = obj["metadata"].get("annotations") or {}
    hooks = {h.strip() for h in str(ann.get("helm.sh/hook", "")).split(",") if h.strip()}
    weight = ann.get("helm.sh/hook-weight")
    policy = {p.strip() for p in str(ann.get("helm.sh/hook-delete-policy", "")).split(",") if p.strip()}
    return hooks, (int(weight) if weight is not None else None), policy


def check_container_security(report: Report, where: str, pod: dict[str, Any]) -> None:
    psc = pod.get("securityContext") or {}
    report.check(psc.get("runAsNonRoot") is True, f"{where}: pod securityContext.runAsNonRoot is not true")
    report.check(psc.get("runAsUser") == RUN_AS and psc.get("runAsGroup") == RUN_AS, f"{where}: pod does not run as {RUN_AS}:{RUN_AS}")
    report.check(psc.get("fsGroup") == RUN_AS, f"{where}: pod fsGroup is not {RUN_AS}")
    report.check((psc.get("seccompProfile") or {}).get("type") == "RuntimeDefault", f"{where}: pod seccompProfile is not RuntimeDefault")
    report.check(pod.get("automountServiceAccountToken") is False, f"{where}: automountServiceAccountToken is not false")
    containers = (pod.get("initContainers") or []) + (pod.get("containers") or [])
    report.check(containers, f"{where}: no containers")
    for c in containers:
        cw = f"{where}: container {c.get('name')}"
        sc = c.get("securityContext") or {}
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        user = sc.get("runAsUser", psc.get("runAsUser"))
        report.check(non_root is True and user not in (None, 0), f"{cw}: may run as root")
        report.check(sc.get("readOnlyRootFilesystem") is True, f"{cw}: readOnlyRootFilesystem is not true")
        report.check(sc.get("allowPrivilegeEscalation") is False, f"{cw}: allowPrivilegeEscalation is not false")
        report.check(sc.get("privileged") is not True, f"{cw}: privileged")
        caps = sc.get("capabilities") or {}
        report.check("ALL" in (caps.get("drop") or []), f"{cw}: capabilities.drop does not contain ALL")
        report.check(not caps.get("add"), f"{cw}: adds capabilities {caps.get('add')}")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        report.check(seccomp == "RuntimeDefault", f"{cw}: seccompProfile is not RuntimeDefault")
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts") or []}
        vols = {v["name"]: v for v in pod.get("volumes") or []}
        tmp = vols.get(mounts.get("/tmp", ""), {})
        report.check("emptyDir" in tmp, f"{cw}: /tmp is not an emptyDir (the root filesystem is read-only)")
        for e in c.get("env") or []:
            if e["name"] in ("HCP_SENSE_DATABASE_URL", "DATABASE_URL", "HCP_SENSE_PAGE_TOKEN_SECRET", NATS_ENV):
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                report.check("value" not in e and ref and ref.get("name") and ref.get("key"), f"{cw}: {e['name']} is not taken from a secretKeyRef")
    text = json.dumps(pod)
    report.check("postgres://" not in text and "postgresql://" not in text, f"{where}: a database URL is written into the pod spec")
    report.check(not re.search(r"\b(nats|tls|wss?)://", text) and "--nats-url" not in text, f"{where}: a NATS URL is written into the pod spec (it may carry credentials; it comes from a Secret)")


def nats_secret_name(merged: dict[str, Any], dep: dict[str, Any]) -> str:
    """The Secret the NATS URL should come from: the chart's own (<fullname>-nats) when nats.url
    is set, else nats.existingSecret."""
    if merged["nats"]["url"]:
        full = dep["metadata"]["name"]
        return f"{full[: 62 - len('nats')]}-nats"
    return merged["nats"]["existingSecret"]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env") or []}


def check_scenario(
    report: Report,
    r: Rendered,
    merged: dict[str, Any],
    binary: Path,
    dashboard_text: str,
) -> str | None:
    """Asserts the properties of one rendering, given the values as Helm merged them (chart
    defaults + overrides); returns its config.toml."""
    label = r.label
    tls = merged["tls"]["enabled"]
    autoscaling = merged["autoscaling"]["enabled"]

    dep = r.one(report, "Deployment")
    services = r.of_kind("Service")
    headless = [o for o in services if o["metadata"]["name"].endswith("-headless")]
    ingress_services = [o for o in services if o["metadata"]["name"].endswith("-ingress")]
    main_services = [o for o in services if o not in headless and o not in ingress_services]
    report.check(len(main_services) == 1, f"{label}: expected one Service besides the headless and ingress ones, found {len(main_services)}")
    svc = main_services[0] if len(main_services) == 1 else None
    if merged["service"].get("headless"):
        if report.check(len(headless) == 1, f"{label}: service.headless but no <fullname>-headless Service"):
            h = headless[0]
            report.check(h["spec"].get("clusterIP") == "None", f"{label}: the headless Service has clusterIP {h['spec'].get('clusterIP')!r}")
            report.check(len(h["metadata"]["name"]) <= 63, f"{label}: the headless Service's name is over 63 characters")
            report.check([p.get("name") for p in h["spec"].get("ports", [])] == ["grpc"], f"{label}: the headless Service should expose the gRPC port only")
            if svc is not None:
                report.check(h["spec"].get("selector") == svc["spec"].get("selector"), f"{label}: the headless Service selects other pods than the Service")
    else:
        report.check(not headless, f"{label}: a headless Service without service.headless")
    cm = next((o for o in r.of_kind("ConfigMap") if "config.toml" in (o.get("data") or {})), None)
    report.check(cm is not None, f"{label}: no ConfigMap with config.toml")
    if dep is None or svc is None or cm is None:
        return None

    # --- config.toml
    toml_text = cm["data"]["config.toml"]
    config: dict[str, Any] = {}
    try:
        config = tomllib.loads(toml_text)
    except tomllib.TOMLDecodeError as e:
        report.fail(f"{label}: config.toml does not parse: {e}")
    report.check(config.get("listen") == f"0.0.0.0:{GRPC_PORT}", f"{label}: config.toml listen is {config.get('listen')!r}, expected 0.0.0.0:{GRPC_PORT}")
    report.check(config.get("metrics_listen") == f"0.0.0.0:{METRICS_PORT}", f"{label}: config.toml metrics_listen is {config.get('metrics_listen')!r}, expected 0.0.0.0:{METRICS_PORT}")
    report.check(config.get("migrate") is False, f"{label}: config.toml should set migrate = false (the hook Job migrates)")
    ok, why = binary_accepts(binary, toml_text)
    report.check(ok, f"{label}: `hcp-sense check-config` refuses config.toml: {why}")
    listener = merged["ingressListener"]
    if listener["enabled"]:
        report.check(config.get("ingress_listen") == f"0.0.0.0:{INGRESS_PORT}", f"{label}: config.toml ingress_listen is {config.get('ingress_listen')!r}, expected 0.0.0.0:{INGRESS_PORT}")
    else:
        report.check("ingress_listen" not in config, f"{label}: config.toml has ingress_listen although ingressListener.enabled is false")
    if merged["mcp"]["enabled"]:
        report.check(config.get("mcp_listen") == f"0.0.0.0:{MCP_PORT}", f"{label}: config.toml mcp_listen is {config.get('mcp_listen')!r}, expected 0.0.0.0:{MCP_PORT}")
    else:
        report.check("mcp_listen" not in config, f"{label}: config.toml has mcp_listen although mcp.enabled is false")
    http = merged["http"]
    if http["enabled"]:
        report.check(config.get("http_listen") == f"0.0.0.0:{HTTP_PORT}", f"{label}: config.toml http_listen is {config.get('http_listen')!r}, expected 0.0.0.0:{HTTP_PORT}")
    else:
        report.check("http_listen" not in config, f"{label}: config.toml has http_listen although http.enabled is false")
    if http["enabled"] and http["console"]:
        report.check(config.get("console") is True, f"{label}: config.toml console is {config.get('console')!r}, expected true (http.console)")
    else:
        report.check("console" not in config, f"{label}: config.toml has console although http.console is false or http.enabled is false")
    for secret_key in ("database_url", "page_token_secret", "auth", "nats_url"):
        report.check(secret_key not in config, f"{label}: config.toml (a ConfigMap) must not carry {secret_key}; it comes from a Secret")
    report.check(config.get("insecure_no_auth", False) == merged["insecureNoAuth"], f"{label}: insecure_no_auth does not follow insecureNoAuth")
    report.check(config.get("log_format") == merged["config"]["logFormat"], f"{label}: log_format does not follow config.logFormat")
    if tls:
        report.check(str(config.get("tls_cert_file", "")).startswith("/") and str(config.get("tls_key_file", "")).startswith("/"), f"{label}: TLS on but tls_cert_file / tls_key_file not set")
    else:
        report.check(not any(k.startswith("tls_") for k in config), f"{label}: TLS off but config.toml has tls_* keys")
    grace = config.get("shutdown_grace_secs", 30)

    # --- Deployment
    spec = dep["spec"]
    pod_meta = spec["template"]["metadata"]
    pod = spec["template"]["spec"]
    where = f"{label}: Deployment"
    if autoscaling:
        report.check("replicas" not in spec, f"{where}: sets replicas although the HorizontalPodAutoscaler owns them")
        hpa = r.one(report, "HorizontalPodAutoscaler")
        if hpa:
            h = hpa["spec"]
            report.check(hpa["apiVersion"] == "autoscaling/v2", f"{label}: HPA apiVersion {hpa['apiVersion']}")
            report.check(h["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": dep["metadata"]["name"]}, f"{label}: HPA does not target the Deployment")
            report.check(h["minReplicas"] == merged["autoscaling"]["minReplicas"] and h["maxReplicas"] == merged["autoscaling"]["maxReplicas"], f"{label}: HPA min/max {h['minReplicas']}/{h['maxReplicas']} do not follow values")
            cpu = [m for m in h.get("metrics", []) if m.get("type") == "Resource" and m["resource"]["name"] == "cpu"]
            report.check(cpu and cpu[0]["resource"]["target"] == {"type": "Utilization", "averageUtilization": merged["autoscaling"]["targetCPUUtilizationPercentage"]}, f"{label}: HPA has no CPU utilisation target from values")
    else:
        report.check(spec.get("replicas") == merged["replicaCount"], f"{where}: replicas {spec.get('replicas')} != replicaCount {merged['replicaCount']}")
        report.check(not r.of_kind("HorizontalPodAutoscaler"), f"{label}: HPA rendered although autoscaling is off")
    selector = spec["selector"]["matchLabels"]
    report.check(matches(selector, pod_meta["labels"]), f"{where}: selector does not match the pod labels")
    report.check(matches(svc["spec"]["selector"], pod_meta["labels"]), f"{label}: the Service selects no server pod")
    check_container_security(report, where, pod)
    report.check(pod.get("serviceAccountName") in {o["metadata"]["name"] for o in r.of_kind("ServiceAccount")} or not merged["serviceAccount"]["create"], f"{where}: serviceAccountName is not the chart's ServiceAccount")
    for sa in r.of_kind("ServiceAccount"):
        report.check(sa.get("automountServiceAccountToken") is False, f"{label}: ServiceAccount mounts its token")
    tgps = pod.get("terminationGracePeriodSeconds")
    pre_stop = (((pod["containers"][0].get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}).get("seconds", 0)
    report.check(isinstance(tgps, int) and tgps > grace + pre_stop, f"{where}: terminationGracePeriodSeconds {tgps} must exceed shutdown_grace_secs {grace} + preStop sleep {pre_stop}")
    annotations = pod_meta.get("annotations") or {}
    cm_text = r_manifest_text(r, cm)
    cm_sum = hashlib.sha256(cm_text.encode()).hexdigest() if cm_text else None
    report.check(annotations.get("checksum/config") and annotations.get("checksum/config") == cm_sum, f"{where}: pod annotation checksum/config is missing or is not the sha256 of the rendered ConfigMap")
    report.check(pod.get("topologySpreadConstraints") or (pod.get("affinity") or {}).get("podAntiAffinity"), f"{where}: no spreading across nodes")
    for tsc in pod.get("topologySpreadConstraints") or []:
        report.check(tsc.get("whenUnsatisfiable") == "ScheduleAnyway", f"{where}: default spread is not soft (ScheduleAnyway)")
        report.check(matches(tsc["labelSelector"]["matchLabels"], pod_meta["labels"]), f"{where}: spread labelSelector does not select the pods")

    containers = pod["containers"]
    report.check(len(containers) == 1, f"{where}: expected one container, found {len(containers)}")
    c = containers[0]
    ports = {p["name"]: p["containerPort"] for p in c.get("ports") or []}
    want_ports = {"grpc": GRPC_PORT, "metrics": METRICS_PORT} | ({"ingress": INGRESS_PORT} if listener["enabled"] else {}) | ({"mcp": MCP_PORT} if merged["mcp"]["enabled"] else {}) | ({"http": HTTP_PORT} if http["enabled"] else {})
    report.check(ports == want_ports, f"{where}: container ports {ports}, expected {want_ports}")
    args = c.get("args") or []
    report.check(not any(str(a).startswith("--nats-url") for a in args), f"{where}: the NATS URL is an argument ({args}); it may carry credentials")
    report.check(args[:1] == ["serve"] and "--config" in args, f"{where}: args {args} do not run `serve --config FILE`")
    if "--config" in args and args.index("--config") + 1 < len(args):
        config_path = args[args.index("--config") + 1]
        mounts = {m["name"]: m for m in c.get("volumeMounts") or []}
        vols = {v["name"]: v for v in pod.get("volumes") or []}
        mounted = [
            m for m in mounts.values()
            if config_path == f"{m['mountPath'].rstrip('/')}/config.toml"
            and vols.get(m["name"], {}).get("configMap", {}).get("name") == cm["metadata"]["name"]
        ]
        report.check(mounted, f"{where}: {config_path} is not config.toml of ConfigMap {cm['metadata']['name']}")
    env = env_of(c)
    for name in ("HCP_SENSE_DATABASE_URL", "HCP_SENSE_PAGE_TOKEN_SECRET"):
        ref = (env.get(name, {}).get("valueFrom") or {}).get("secretKeyRef")
        report.check(ref is not None and "value" not in env.get(name, {}), f"{where}: {name} must come from a secretKeyRef")
    if merged["auth"]["existingSecret"]:
        auth_file = env.get("HCP_SENSE_AUTH_FILE", {}).get("value", "")
        vols = {v["name"]: v for v in pod.get("volumes") or []}
        auth_mounts = [
            m for m in c.get("volumeMounts") or []
            if auth_file.startswith(m["mountPath"].rstrip("/") + "/")
            and vols.get(m["name"], {}).get("secret", {}).get("secretName") == merged["auth"]["existingSecret"]
        ]
        report.check(auth_mounts and all(m.get("readOnly") for m in auth_mounts), f"{where}: HCP_SENSE_AUTH_FILE={auth_file!r} is not a file of the read-only mounted Secret {merged['auth']['existingSecret']}")
    else:
        report.check("HCP_SENSE_AUTH_FILE" not in env, f"{where}: HCP_SENSE_AUTH_FILE set without an auth Secret")
    if merged["otel"]["endpoint"]:
        report.check(env.get("OTEL_EXPORTER_OTLP_ENDPOINT", {}).get("value") == merged["otel"]["endpoint"], f"{where}: OTEL_EXPORTER_OTLP_ENDPOINT does not follow otel.endpoint")
    nats = merged["nats"]
    nats_secret = nats_secret_name(merged, dep) if (nats["url"] or nats["existingSecret"]) else None
    nats_ref = (env.get(NATS_ENV, {}).get("valueFrom") or {}).get("secretKeyRef")
    if nats_secret:
        report.check(
            nats_ref == {"name": nats_secret, "key": nats["secretKey"]} and "value" not in env.get(NATS_ENV, {}),
            f"{where}: {NATS_ENV} should come from secretKeyRef {nats_secret}/{nats['secretKey']}, is {env.get(NATS_ENV)}",
        )
        made = [s for s in r.of_kind("Secret") if s["metadata"]["name"] == nats_secret]
        if nats["url"]:
            if report.check(len(made) == 1, f"{label}: nats.url set but the chart renders no Secret {nats_secret}"):
                data = made[0].get("stringData") or {}
                report.check(data.get(nats["secretKey"]) == nats["url"], f"{label}: Secret {nats_secret} does not hold nats.url under {nats['secretKey']}")
                report.check(not hook_set(made[0])[0], f"{label}: Secret {nats_secret} is a hook; only the servers read it")
            report.check("hcp-sense/secrets-revision" in (pod_meta.get("annotations") or {}), f"{where}: no secrets-revision annotation although the chart creates the NATS Secret")
        else:
            report.check(not made, f"{label}: the chart renders Secret {nats_secret} although nats.existingSecret names it")
    else:
        report.check(NATS_ENV not in env, f"{where}: {NATS_ENV} set without nats.url or nats.existingSecret")
        report.check(not any(s["metadata"]["name"].endswith("-nats") for s in r.of_kind("Secret")), f"{label}: a NATS Secret without NATS")
    for o in r.of_kind("ConfigMap"):
        report.check(not re.search(r"\b(nats|tls|wss?)://", json.dumps(o.get("data") or {})), f"{label}: ConfigMap {o['metadata']['name']} carries a NATS URL")

    probes = {k: c.get(k) or {} for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    for k, p in probes.items():
        report.check(p, f"{where}: no {k}")
        # The ingress port has no health endpoint (and takes only signed POSTs).
        target = next((v.get("port") for v in p.values() if isinstance(v, dict) and "port" in v), None)
        report.check(target not in ("ingress", INGRESS_PORT), f"{where}: {k} probes the ingress port: {p}")
    if tls:
        def http_ok(p: dict[str, Any], path: str) -> bool:
            g = p.get("httpGet") or {}
            port = g.get("port")
            port = ports.get(port, port)
            return g.get("path") == path and port == METRICS_PORT and "grpc" not in p
        report.check(http_ok(probes["readinessProbe"], "/readyz"), f"{where}: TLS on: readinessProbe should be httpGet /readyz on {METRICS_PORT}, is {probes['readinessProbe']}")
        report.check(http_ok(probes["startupProbe"], "/readyz"), f"{where}: TLS on: startupProbe should be httpGet /readyz on {METRICS_PORT}, is {probes['startupProbe']}")
        report.check(http_ok(probes["livenessProbe"], "/healthz"), f"{where}: TLS on: livenessProbe should be httpGet /healthz on {METRICS_PORT}, is {probes['livenessProbe']}")
    else:
        for k in ("startupProbe", "readinessProbe"):
            g = probes[k].get("grpc") or {}
            report.check(g.get("port") == GRPC_PORT and g.get("service", "") == "", f"{where}: {k} should be grpc on {GRPC_PORT} with service \"\", is {probes[k]}")
        g = probes["livenessProbe"].get("grpc") or {}
        report.check(g.get("port") == GRPC_PORT and g.get("service") == "liveness", f"{where}: livenessProbe should be grpc on {GRPC_PORT} with service \"liveness\", is {probes['livenessProbe']}")

    # --- Service
    sports = {p["name"]: p for p in svc["spec"]["ports"]}
    g = sports.get("grpc", {})
    report.check(g.get("port") == merged["service"]["grpcPort"] and g.get("appProtocol") == "grpc" and g.get("targetPort") in ("grpc", GRPC_PORT), f"{label}: Service port grpc should be {merged['service']['grpcPort']} → 50051 with appProtocol grpc, is {g}")
    mp = sports.get("metrics", {})
    report.check(mp.get("port") == merged["service"]["metricsPort"] and mp.get("targetPort") in ("metrics", METRICS_PORT), f"{label}: Service port metrics should be {merged['service']['metricsPort']} → 9464, is {mp}")
    report.check(svc["spec"]["type"] == merged["service"]["type"], f"{label}: Service type")
    mcp = sports.get("mcp")
    if merged["mcp"]["enabled"]:
        report.check(mcp and mcp.get("port") == merged["service"]["mcpPort"] and mcp.get("targetPort") in ("mcp", MCP_PORT), f"{label}: Service port mcp should be {merged['service']['mcpPort']} → {MCP_PORT}, is {mcp}")
    else:
        report.check(mcp is None, f"{label}: the Service has an mcp port although mcp.enabled is false")
    hp = sports.get("http")
    if http["enabled"]:
        report.check(hp and hp.get("port") == merged["service"]["httpPort"] and hp.get("targetPort") in ("http", HTTP_PORT), f"{label}: Service port http should be {merged['service']['httpPort']} → {HTTP_PORT}, is {hp}")
    else:
        report.check(hp is None, f"{label}: the Service has an http port although http.enabled is false")
    report.check(len({p["port"] for p in svc["spec"]["ports"]}) == len(svc["spec"]["ports"]), f"{label}: the Service has two ports with the same number: {svc['spec']['ports']}")
    separate = listener["enabled"] and listener["service"]["enabled"]
    ip = sports.get("ingress")
    if listener["enabled"] and not separate:
        report.check(ip and ip.get("port") == merged["service"]["ingressPort"] and ip.get("targetPort") in ("ingress", INGRESS_PORT), f"{label}: Service port ingress should be {merged['service']['ingressPort']} → {INGRESS_PORT}, is {ip}")
    else:
        report.check(ip is None, f"{label}: the Service has an ingress port although " + ("the listener has a Service of its own" if separate else "ingressListener.enabled is false"))
    if separate:
        if report.check(len(ingress_services) == 1, f"{label}: ingressListener.service.enabled but no <fullname>-ingress Service"):
            isvc = ingress_services[0]
            ispec = isvc["spec"]
            iports = ispec.get("ports") or []
            report.check(len(isvc["metadata"]["name"]) <= 63, f"{label}: the ingress Service's name is over 63 characters")
            report.check(
                [(p.get("name"), p.get("port"), p.get("targetPort")) for p in iports] == [("ingress", listener["service"]["port"], "ingress")],
                f"{label}: the ingress Service should carry the ingress port alone ({listener['service']['port']} → ingress), has {iports}",
            )
            report.check(ispec.get("type") == listener["service"]["type"], f"{label}: the ingress Service's type is {ispec.get('type')}")
            report.check(matches(ispec.get("selector") or {}, pod_meta["labels"]) and ispec.get("selector") == svc["spec"].get("selector"), f"{label}: the ingress Service selects other pods than the Service")
            if listener["service"]["type"] != "ClusterIP":
                report.check(ispec.get("externalTrafficPolicy") == listener["service"]["externalTrafficPolicy"], f"{label}: the ingress Service's externalTrafficPolicy does not follow values")
            if listener["service"]["type"] == "LoadBalancer" and listener["service"]["loadBalancerSourceRanges"]:
                report.check(ispec.get("loadBalancerSourceRanges") == listener["service"]["loadBalancerSourceRanges"], f"{label}: loadBalancerSourceRanges do not follow values")
    else:
        report.check(not ingress_services, f"{label}: an ingress Service without ingressListener.service.enabled")
    if listener["enabled"]:
        report.check("/v1/ingress/" in r.notes, f"{label}: NOTES.txt does not say where the ingress listener is")

    # --- migration Job
    jobs = r.of_kind("Job")
    secret_ref = (env.get("HCP_SENSE_DATABASE_URL", {}).get("valueFrom") or {}).get("secretKeyRef") or {}
    job_weight = None
    if merged["migrations"]["enabled"]:
        job = r.one(report, "Job")
        if job:
            jw = f"{label}: migration Job"
            hooks, job_weight, policy = hook_set(job)
            report.check(hooks == {"pre-install", "pre-upgrade"}, f"{jw}: helm.sh/hook is {hooks}, expected pre-install,pre-upgrade")
            report.check(job_weight is not None, f"{jw}: no helm.sh/hook-weight")
            report.check(policy == {"before-hook-creation", "hook-succeeded"}, f"{jw}: hook-delete-policy is {policy}")
            js = job["spec"]
            report.check(isinstance(js.get("backoffLimit"), int) and isinstance(js.get("activeDeadlineSeconds"), int), f"{jw}: backoffLimit / activeDeadlineSeconds not set")
            jpod = js["template"]["spec"]
            report.check(jpod.get("restartPolicy") in ("Never", "OnFailure"), f"{jw}: restartPolicy {jpod.get('restartPolicy')}")
            check_container_security(report, jw, jpod)
            report.check(jpod.get("securityContext") == pod.get("securityContext"), f"{jw}: pod securityContext differs from the Deployment's")
            jc = jpod["containers"][0]
            report.check(jc.get("image") == c.get("image"), f"{jw}: image {jc.get('image')} is not the server's {c.get('image')}")
            words = (jc.get("command") or []) + (jc.get("args") or [])
            report.check(words[-2:] == ["migrate", "up"], f"{jw}: runs {words}, expected `hcp-sense migrate up`")
            jref = (env_of(jc).get("HCP_SENSE_DATABASE_URL", {}).get("valueFrom") or {}).get("secretKeyRef")
            report.check(jref == secret_ref, f"{jw}: reads the database URL from {jref}, the server from {secret_ref}")
            jlabels = js["template"]["metadata"].get("labels") or {}
            report.check(not matches(svc["spec"]["selector"], jlabels), f"{jw}: its pods match the Service selector")
            sa = jpod.get("serviceAccountName")
            report.check(sa is None or sa not in {o["metadata"]["name"] for o in r.of_kind("ServiceAccount")}, f"{jw}: uses the chart's ServiceAccount {sa}, which does not exist yet when pre-install hooks run")
    else:
        report.check(not jobs, f"{label}: migration Job rendered although migrations.enabled is false")

    # --- Secrets the chart creates
    for s in r.of_kind("Secret"):
        sw = f"{label}: Secret {s['metadata']['name']}"
        if s["metadata"]["name"] == secret_ref.get("name"):
            hooks, weight, policy = hook_set(s)
            report.check(hooks == {"pre-install", "pre-upgrade"}, f"{sw}: the database Secret the chart creates must be a pre-install,pre-upgrade hook (the migration Job needs it), is {hooks}")
            report.check(weight is not None and job_weight is not None and weight < job_weight, f"{sw}: hook weight {weight} must be lower than the Job's {job_weight}")
            report.check("hook-succeeded" not in policy, f"{sw}: hook-succeeded would delete the Secret the servers need")
            report.check(secret_ref.get("key") in (s.get("stringData") or s.get("data") or {}), f"{sw}: has no key {secret_ref.get('key')}")
    if merged["database"]["url"]:
        report.check(any(s["metadata"]["name"] == secret_ref.get("name") for s in r.of_kind("Secret")), f"{label}: database.url set but the chart renders no Secret {secret_ref.get('name')}")
        report.check("hcp-sense/secrets-revision" in annotations, f"{where}: no secrets-revision annotation although the chart creates a Secret (the pods would keep the old one)")
        report.check(not any("checksum" in k and "secret" in k for k in annotations), f"{where}: a checksum of the Secrets in the pod spec publishes a hash of the password")
    else:
        report.check(secret_ref.get("name") == merged["database"]["existingSecret"], f"{where}: database Secret {secret_ref.get('name')} is not database.existingSecret")

    # --- PodDisruptionBudget
    pdbs = r.of_kind("PodDisruptionBudget")
    if merged["podDisruptionBudget"]["enabled"]:
        pdb = r.one(report, "PodDisruptionBudget")
        if pdb:
            report.check(pdb["apiVersion"] == "policy/v1", f"{label}: PDB apiVersion {pdb['apiVersion']}")
            report.check(matches(pdb["spec"]["selector"]["matchLabels"], pod_meta["labels"]), f"{label}: PDB does not select the pods")
            report.check(("minAvailable" in pdb["spec"]) != ("maxUnavailable" in pdb["spec"]), f"{label}: PDB must set exactly one of minAvailable / maxUnavailable")
    else:
        report.check(not pdbs, f"{label}: PDB rendered although disabled")

    # --- ServiceMonitor
    sms = r.of_kind("ServiceMonitor")
    if merged["serviceMonitor"]["enabled"]:
        sm = r.one(report, "ServiceMonitor")
        if sm:
            report.check(matches(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"]), f"{label}: ServiceMonitor does not select the Service")
            eps = sm["spec"]["endpoints"]
            report.check(all(e.get("port") in sports for e in eps), f"{label}: ServiceMonitor endpoint port is not a Service port name")
            report.check(all(e.get("path", "/metrics") == "/metrics" for e in eps), f"{label}: ServiceMonitor path is not /metrics")
            for e in eps:
                if "interval" in e and "scrapeTimeout" in e:
                    report.check(seconds(e["scrapeTimeout"]) <= seconds(e["interval"]), f"{label}: ServiceMonitor scrapeTimeout exceeds interval")
    else:
        report.check(not sms, f"{label}: ServiceMonitor rendered although serviceMonitor.enabled is false")

    # --- NetworkPolicy
    nps = r.of_kind("NetworkPolicy")
    if merged["networkPolicy"]["enabled"]:
        server_np = [n for n in nps if matches(n["spec"]["podSelector"].get("matchLabels", {}), pod_meta["labels"])]
        if report.check(len(server_np) == 1, f"{label}: expected one NetworkPolicy selecting the server pods, found {len(server_np)}"):
            np = server_np[0]["spec"]
            report.check(set(np.get("policyTypes", [])) == {"Ingress", "Egress"}, f"{label}: NetworkPolicy policyTypes {np.get('policyTypes')}")
            in_ports = {ports.get(p["port"], p["port"]) for rule in np.get("ingress", []) for p in rule.get("ports", [])}
            report.check({GRPC_PORT, METRICS_PORT} <= in_ports, f"{label}: NetworkPolicy ingress ports {in_ports} miss gRPC or metrics")
            # By number, or by the name the container gives it (present or not).
            ingress_rules = [rule for rule in np.get("ingress", []) if any(ports.get(p["port"], p["port"]) in (INGRESS_PORT, "ingress") for p in rule.get("ports", []))]
            if listener["enabled"]:
                if report.check(len(ingress_rules) == 1, f"{label}: NetworkPolicy should have one rule for the ingress port, has {len(ingress_rules)}"):
                    rule = ingress_rules[0]
                    report.check([ports.get(p["port"], p["port"]) for p in rule["ports"]] == [INGRESS_PORT], f"{label}: the NetworkPolicy's ingress rule opens more than the ingress port: {rule['ports']}")
                    report.check(rule.get("from", []) == merged["networkPolicy"]["ingressFrom"], f"{label}: the NetworkPolicy's ingress rule admits {rule.get('from', 'every source')}, expected networkPolicy.ingressFrom {merged['networkPolicy']['ingressFrom']}")
            else:
                report.check(not ingress_rules and not {INGRESS_PORT, "ingress"} & in_ports, f"{label}: NetworkPolicy opens the ingress port although ingressListener.enabled is false")
            mcp_rules = [rule for rule in np.get("ingress", []) if any(ports.get(p["port"], p["port"]) in (MCP_PORT, "mcp") for p in rule.get("ports", []))]
            if merged["mcp"]["enabled"]:
                if report.check(len(mcp_rules) == 1, f"{label}: NetworkPolicy should have one rule for the MCP port, has {len(mcp_rules)}"):
                    report.check(mcp_rules[0].get("from", []) == merged["networkPolicy"]["mcpFrom"], f"{label}: the NetworkPolicy's MCP rule admits {mcp_rules[0].get('from', 'every source')}, expected networkPolicy.mcpFrom")
            else:
                report.check(not mcp_rules, f"{label}: NetworkPolicy opens the MCP port although mcp.enabled is false")
            http_rules = [rule for rule in np.get("ingress", []) if any(ports.get(p["port"], p["port"]) in (HTTP_PORT, "http") for p in rule.get("ports", []))]
            if http["enabled"]:
                if report.check(len(http_rules) == 1, f"{label}: NetworkPolicy should have one rule for the JSON door's port, has {len(http_rules)}"):
                    report.check([ports.get(p["port"], p["port"]) for p in http_rules[0]["ports"]] == [HTTP_PORT], f"{label}: the NetworkPolicy's JSON door rule opens more than the JSON door's port: {http_rules[0]['ports']}")
                    report.check(http_rules[0].get("from", []) == merged["networkPolicy"]["httpFrom"], f"{label}: the NetworkPolicy's JSON door rule admits {http_rules[0].get('from', 'every source')}, expected networkPolicy.httpFrom")
            else:
                report.check(not http_rules, f"{label}: NetworkPolicy opens the JSON door's port although http.enabled is false")
            eg = {(p.get("protocol", "TCP"), p["port"]) for rule in np.get("egress", []) for p in rule.get("ports", [])}
            report.check(("UDP", 53) in eg, f"{label}: NetworkPolicy egress has no DNS (UDP 53)")
            report.check(("TCP", merged["networkPolicy"]["postgres"]["port"]) in eg, f"{label}: NetworkPolicy egress has no PostgreSQL port")
            if merged["networkPolicy"]["otlp"]["enabled"]:
                report.check(("TCP", merged["networkPolicy"]["otlp"]["port"]) in eg, f"{label}: NetworkPolicy egress has no OTLP port")
            nats_port = merged["networkPolicy"]["nats"]["port"]
            nats_rules = [rule for rule in np.get("egress", []) if any(p["port"] == nats_port for p in rule.get("ports", []))]
            if nats_secret:
                if report.check(len(nats_rules) == 1, f"{label}: NetworkPolicy egress should have one rule for NATS (port {nats_port}), has {len(nats_rules)}"):
                    report.check(nats_rules[0].get("to", []) == merged["networkPolicy"]["nats"]["to"], f"{label}: the NetworkPolicy's NATS rule goes to {nats_rules[0].get('to', 'every destination')}, expected networkPolicy.nats.to")
            else:
                report.check(not nats_rules, f"{label}: NetworkPolicy opens NATS egress without NATS")
        if merged["migrations"]["enabled"] and jobs:
            jlabels = jobs[0]["spec"]["template"]["metadata"].get("labels") or {}
            job_np = [n for n in nps if matches(n["spec"]["podSelector"].get("matchLabels", {}), jlabels)]
            if report.check(len(job_np) == 1, f"{label}: no NetworkPolicy lets the migration Job reach PostgreSQL"):
                hooks, weight, _ = hook_set(job_np[0])
                report.check(hooks == {"pre-install", "pre-upgrade"} and weight is not None and job_weight is not None and weight < job_weight, f"{label}: the migration Job's NetworkPolicy must be a hook created before the Job")
    else:
        report.check(not nps, f"{label}: NetworkPolicy rendered although networkPolicy.enabled is false")

    # --- Grafana dashboard
    dashboards = [o for o in r.of_kind("ConfigMap") if (o["metadata"].get("labels") or {}).get("grafana_dashboard") is not None]
    if merged["grafanaDashboard"]["enabled"]:
        if report.check(len(dashboards) == 1, f"{label}: expected one ConfigMap labelled grafana_dashboard, found {len(dashboards)}"):
            d = dashboards[0]
            report.check(d["metadata"]["labels"]["grafana_dashboard"] == "1", f"{label}: grafana_dashboard label is not \"1\"")
            data = d.get("data") or {}
            report.check(len(data) == 1, f"{label}: dashboard ConfigMap holds {len(data)} keys, expected 1")
            for key, text in data.items():
                report.check(key.endswith(".json"), f"{label}: dashboard key {key} does not end in .json")
                try:
                    report.check(json.loads(text) == json.loads(dashboard_text), f"{label}: dashboard JSON differs from {DASHBOARD.relative_to(REPO)}")
                except json.JSONDecodeError as e:
                    report.fail(f"{label}: dashboard ConfigMap is not JSON: {e}")
                report.check(text.rstrip() == dashboard_text.rstrip(), f"{label}: dashboard text differs from {DASHBOARD.relative_to(REPO)}")
    else:
        report.check(not dashboards, f"{label}: dashboard ConfigMap rendered although grafanaDashboard.enabled is false")

    report.check(r.notes.strip(), f"{label}: NOTES.txt is empty")
    return toml_text


def r_manifest_text(r: Rendered, obj: dict[str, Any]) -> str | None:
    """The rendered text of the template that produced obj (what Helm's sha256sum hashed)."""
    return r.sources.get(obj["__template"])


def seconds(duration: str) -> float:
    total = 0.0
    for n, unit in re.findall(r"([0-9]+)(ms|s|m|h|d|w|y)", duration):
        total += int(n) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}[unit]
    return total


# ---------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--emit-config", metavar="DIR", type=Path, help="write config.toml (production) and config-default.toml here")
    parser.add_argument("--binary", type=Path, default=REPO / "target" / "debug" / "hcp-sense", help="the hcp-sense binary whose check-config judges each rendered config.toml")
    args = parser.parse_args()

    report = Report()
    dashboard_text = DASHBOARD.read_text()
    production = yaml.safe_load(PRODUCTION_VALUES.read_text()) or {}

    # --- Chart.yaml
    with helm.Chart.load(CHART) as chart:
        meta = chart.metadata
        defaults = chart.values
        schema = chart.schema
    version = crate_version()
    report.check(meta.get("apiVersion") == "v2", f"Chart.yaml: apiVersion {meta.get('apiVersion')}, expected v2")
    report.check(meta.get("type") == "application", f"Chart.yaml: type {meta.get('type')}, expected application")
    report.check(meta.get("version") == "0.1.0", f"Chart.yaml: version {meta.get('version')}, expected 0.1.0")
    report.check(meta.get("appVersion") == version, f"Chart.yaml: appVersion {meta.get('appVersion')} is not the crate version {version} (Cargo.toml)")
    report.check(schema is not None, "values.schema.json: missing")
    if schema:
        report.check(schema.get("$schema", "").startswith("http://json-schema.org/draft-07/schema"), "values.schema.json: not JSON Schema draft-07")
        try:
            jsonschema.Draft7Validator.check_schema(schema)
        except jsonschema.SchemaError as e:
            report.fail(f"values.schema.json: not a valid draft-07 schema: {e.message}")
        report.check(schema.get("additionalProperties") is False, "values.schema.json: top level allows unknown keys")
        top = set(schema.get("properties", {})) - {"global"}
        report.check(top == set(defaults), f"values.schema.json and values.yaml disagree on top-level keys: {sorted(top ^ set(defaults))}")
    readme = (CHART / "README.md").read_text() if (CHART / "README.md").exists() else ""
    report.check(readme, "helm/hcp-sense/README.md: missing")
    for key in defaults:
        report.check(re.search(rf"`{re.escape(key)}[`.]", readme), f"helm/hcp-sense/README.md: the values table does not mention `{key}`")

    # --- 1. lint
    lint(report, "default values", {})
    lint(report, "values-production.yaml", production)

    # --- 2 and 3. render, validate, assert
    with helm.Chart.load(CHART) as chart:
        merge = chart.merge_values
        scenarios: list[tuple[str, dict[str, Any], bool]] = [
            ("default install", {}, False),
            ("default upgrade", {}, True),
            ("production install", production, False),
            ("production upgrade", production, True),
            ("database.url (chart-made Secret)", {"database": {"url": "postgres://sense:pw@db.hcp.svc:5432/sense"}, "pageToken": {"value": "0123456789abcdef"}}, False),
            ("insecureNoAuth without auth", {"insecureNoAuth": True, "auth": {"existingSecret": ""}}, False),
            ("TLS with client CA, no extras", {"tls": {"enabled": True, "clientCa": {"enabled": True}}, "grafanaDashboard": {"enabled": False}, "podDisruptionBudget": {"enabled": False}, "migrations": {"enabled": False}}, False),
            ("networkPolicy alone", {"networkPolicy": {"enabled": True}}, False),
            (
                "ingress listener on the Service, NATS from an existing Secret",
                {
                    "ingressListener": {"enabled": True},
                    "service": {"ingressPort": 8443},
                    "nats": {"existingSecret": "hcp-sense-nats", "secretKey": "nats-url"},
                    "networkPolicy": {"enabled": True, "ingressFrom": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8"]}}]},
                },
                False,
            ),
            (
                "ingress listener on a LoadBalancer of its own, NATS URL given to the chart",
                {
                    "ingressListener": {"enabled": True, "service": {"enabled": True, "port": 443, "externalTrafficPolicy": "Local", "loadBalancerSourceRanges": ["203.0.113.0/24"], "annotations": {"service.beta.kubernetes.io/aws-load-balancer-type": "nlb"}}},
                    "nats": {"url": "nats://sense:pw@nats.nats.svc:4222"},
                    "networkPolicy": {"enabled": True, "nats": {"port": 4222, "to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "nats"}}}]}},
                },
                True,
            ),
            ("the MCP door, behind a NetworkPolicy", {"mcp": {"enabled": True}, "service": {"mcpPort": 8091}, "networkPolicy": {"enabled": True, "mcpFrom": [{"namespaceSelector": {"matchLabels": {"team": "harness"}}}]}}, False),
            ("the JSON door and the console, behind a NetworkPolicy", {"http": {"enabled": True, "console": True}, "service": {"httpPort": 8443}, "networkPolicy": {"enabled": True, "httpFrom": [{"namespaceSelector": {"matchLabels": {"team": "ops"}}}]}}, False),
            ("the JSON door without the console", {"http": {"enabled": True}}, True),
            (
                "the MCP and JSON doors beside TLS, behind a NetworkPolicy",
                {
                    "tls": {"enabled": True},
                    "mcp": {"enabled": True},
                    "http": {"enabled": True, "console": True},
                    "networkPolicy": {"enabled": True, "mcpFrom": [{"podSelector": {"matchLabels": {"role": "harness"}}}]},
                },
                True,
            ),
            ("ingress listener alone, on a ClusterIP Service of its own", {"ingressListener": {"enabled": True, "service": {"enabled": True, "type": "ClusterIP"}}}, False),
            ("63-character fullnameOverride", deep_merge(production, {"fullnameOverride": "h" * 63, "database": {"url": "postgres://a@b/c"}}), False),
        ]
        merged_values = {label: merge(values) for label, values, _ in scenarios}
    configs: dict[str, str] = {}
    for label, values, upgrade in scenarios:
        report.scenarios.append(label)
        try:
            manifests = render(values, upgrade=upgrade)
        except helm.HelmError as e:
            report.fail(f"{label}: rendering failed: {e}")
            continue
        r = Rendered(report, label, manifests)
        validate_objects(report, r)
        toml_text = check_scenario(report, r, merged_values[label], args.binary, dashboard_text)
        if toml_text is not None:
            configs[label] = toml_text

    # A change to config.toml must change the pods' checksum (so the pods roll).
    try:
        a = Rendered(report, "checksum", render({}))
        b = Rendered(report, "checksum", render({"config": {"maxJsonDepth": 33}}))
        sums = [
            (x.one(report, "Deployment") or {}).get("spec", {}).get("template", {}).get("metadata", {}).get("annotations", {}).get("checksum/config")
            for x in (a, b)
        ]
        report.check(sums[0] and sums[1] and sums[0] != sums[1], "a config change does not change the pods' checksum/config annotation")
    except helm.HelmError as e:
        report.fail(f"checksum: rendering failed: {e}")

    # --- 4. what must be refused
    refused = [
        ("an unknown top-level key", {"replicas": 3}, "replicas"),
        ("a mistyped nested key", {"config": {"logFromat": "json"}}, "logFromat"),
        ("a wrong type", {"replicaCount": "three"}, "replicaCount"),
        ("a negative port", {"service": {"grpcPort": -1}}, "grpcPort"),
        ("an unknown log format", {"config": {"logFormat": "xml"}}, "logFormat"),
        ("a boolean as a string", {"insecureNoAuth": "false"}, "insecureNoAuth"),
        ("a string for ingressListener.enabled", {"ingressListener": {"enabled": "true"}}, "enabled"),
        ("a mistyped key under ingressListener", {"ingressListener": {"enable": True}}, "enable"),
        ("a string for mcp.enabled", {"mcp": {"enabled": "yes"}}, "enabled"),
        ("a string for http.enabled", {"http": {"enabled": "yes"}}, "enabled"),
        ("a string for http.console", {"http": {"enabled": True, "console": "true"}}, "console"),
        ("a mistyped key under http", {"http": {"enabled": True, "consle": True}}, "consle"),
        ("a JSON door port as a string", {"service": {"httpPort": "8091"}}, "httpPort"),
        ("a JSON door port past 65535", {"service": {"httpPort": 65536}}, "httpPort"),
        ("a JSON door port of 0", {"service": {"httpPort": 0}}, "httpPort"),
        ("a string for networkPolicy.httpFrom", {"networkPolicy": {"httpFrom": "0.0.0.0/0"}}, "httpFrom"),
        ("a string for the ingress Service's port", {"ingressListener": {"service": {"port": "80"}}}, "port"),
        ("an ingress port past 65535", {"service": {"ingressPort": 65536}}, "ingressPort"),
        ("an ingress port of 0", {"service": {"ingressPort": 0}}, "ingressPort"),
        ("an unknown ingress Service type", {"ingressListener": {"service": {"type": "ExternalName"}}}, "type"),
        ("an unknown externalTrafficPolicy", {"ingressListener": {"service": {"externalTrafficPolicy": "Nearest"}}}, "externalTrafficPolicy"),
        ("a source range that is not a CIDR", {"ingressListener": {"service": {"loadBalancerSourceRanges": ["anywhere"]}}}, "loadBalancerSourceRanges"),
        ("a string for networkPolicy.ingressFrom", {"networkPolicy": {"ingressFrom": "0.0.0.0/0"}}, "ingressFrom"),
        ("a number for nats.url", {"nats": {"url": 4222}}, "url"),
        ("a nats.url that is not a NATS URL", {"nats": {"url": "http://nats:4222"}}, "url"),
        ("a list for nats.existingSecret", {"nats": {"existingSecret": ["hcp-sense-nats"]}}, "existingSecret"),
        ("a NATS port as a string", {"networkPolicy": {"nats": {"port": "4222"}}}, "port"),
    ]
    for what, values, needle in refused:
        err = schema_error(values)
        report.check(err and needle in err, f"values.schema.json accepts {what}: {values}" + (f" (error does not name {needle}: {err})" if err else ""))
        err = render_error(values)
        report.check(err and needle in err, f"rendering accepts {what}: {values}")
    for what, values in [
        ("the default values", {}),
        ("values-production.yaml", production),
        # The boundaries of the new ports, and the URL forms NATS takes.
        ("an ingress port of 1", {"service": {"ingressPort": 1}}),
        ("an ingress port of 65535", {"service": {"ingressPort": 65535}, "ingressListener": {"service": {"port": 65535}}}),
        ("NATS servers listed with TLS and credentials", {"nats": {"url": "tls://a:pw@nats-0:4222,tls://a:pw@nats-1:4222"}}),
        ("a JSON door port of 1, with the console", {"http": {"enabled": True, "console": True}, "service": {"httpPort": 1}}),
        ("a JSON door port of 65535", {"http": {"enabled": True}, "service": {"httpPort": 65535}}),
    ]:
        err = schema_error(values)
        report.check(err is None, f"values.schema.json rejects {what}: {err}")
    err = render_error({"auth": {"existingSecret": ""}, "insecureNoAuth": False})
    report.check(err and AUTH_MESSAGE in err and "insecureNoAuth" in err, f"rendering without auth and with insecureNoAuth=false should fail with '{AUTH_MESSAGE} … insecureNoAuth'; got {err!r}")
    err = render_error({"autoscaling": {"enabled": True}, "resources": {"requests": {"cpu": None}}})
    report.check(err and "resources.requests.cpu" in err, f"autoscaling without a CPU request should fail clearly; got {err!r}")
    err = render_error({"podDisruptionBudget": {"minAvailable": 2}, "replicaCount": 2})
    report.check(err and "minAvailable" in err, f"a PodDisruptionBudget that blocks every drain should fail clearly; got {err!r}")
    err = render_error({"podDisruptionBudget": {"minAvailable": 3}, "autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 6}})
    report.check(err and "minAvailable" in err, f"minAvailable at the autoscaler's minimum should fail clearly; got {err!r}")
    for values, needle in [
        ({"ingressListener": {"service": {"enabled": True}}}, "ingressListener.service.enabled needs ingressListener.enabled"),
        ({"http": {"console": True}}, "http.console needs http.enabled"),
        ({"ingressListener": {"enabled": True, "service": {"enabled": True, "type": "ClusterIP", "externalTrafficPolicy": "Local"}}}, "externalTrafficPolicy Local needs"),
        ({"ingressListener": {"enabled": True, "service": {"enabled": True, "type": "NodePort", "loadBalancerSourceRanges": ["203.0.113.0/24"]}}}, "loadBalancerSourceRanges needs"),
    ]:
        err = render_error(values)
        report.check(err and needle in err, f"rendering {values} should fail with '{needle}'; got {err!r}")
    # The MCP port speaks TLS beside a TLS gRPC port, with the same certificate.
    err = render_error({"mcp": {"enabled": True}, "tls": {"enabled": True}})
    report.check(err is None, f"mcp.enabled beside tls.enabled should render; got {err!r}")
    # So does the JSON door (and its console).
    err = render_error({"http": {"enabled": True, "console": True}, "tls": {"enabled": True}})
    report.check(err is None, f"http.enabled beside tls.enabled should render; got {err!r}")
    err = render_error({"database": {"existingSecret": "", "url": ""}})
    report.check(err and "no database configured" in err, f"rendering without any database Secret should fail clearly; got {err!r}")

    # --- 5. --emit-config
    if args.emit_config:
        out = args.emit_config
        out.mkdir(parents=True, exist_ok=True)
        ingress = "ingress listener on the Service, NATS from an existing Secret"
        if "production install" in configs and "default install" in configs and ingress in configs:
            (out / "config.toml").write_text(configs["production install"])
            (out / "config-default.toml").write_text(configs["default install"])
            (out / "config-ingress.toml").write_text(configs[ingress])
            (out / "nats-env").write_text(NATS_ENV)
        else:
            report.fail("--emit-config: no rendered config.toml to write")

    if report.failures:
        print(f"check_chart.py: {len(report.failures)} of {report.checks} checks failed:", file=sys.stderr)
        for f in report.failures:
            print(f"  - {f}", file=sys.stderr)
        return 1
    print(
        f"helm chart OK: lint clean (strict, Kubernetes {KUBE_VERSION}) with default and production values; "
        f"{len(report.scenarios)} renderings, {report.objects_validated} objects valid for Kubernetes {KUBE_VERSION} "
        f"(ServiceMonitor against the script's schema); {report.checks} checks passed; "
        f"every config.toml accepted by {args.binary.name} check-config"
        + (f"; config written to {args.emit_config}" if args.emit_config else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
