"""The deployment kit under deploy/: images, entry point, Kubernetes Jobs, SkyPilot tasks.

Static checks read the files (the Kubernetes overlays built as kustomize builds them); the SkyPilot
tasks' scripts run against a stand-in `docker` that records its arguments; the entry-point tests
run deploy/entrypoint.sh for real (`spotckpt launch` with one worker on the CPU, no Docker): a stop
signal
sent to the entry point must reach the training process, which saves and exits 75, and the entry
point must exit 75 too.

The commands shown in docs/deploy-azure.md are covered here (its covered-by markers).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import spotckpt
from spotckpt.config import Config
from spotckpt.launch import FORWARDED_SIGNALS

from deploy_helpers import (
    ANY_SCRIPT,
    CHECKOV_VERSION,
    DEPLOY,
    DOCKERFILE,
    DOCKERFILE_TRAINER,
    ENTRYPOINT,
    K8S,
    K8S_VARIANTS,
    LAUNCHER_EXIT_S,
    LAUNCHER_MODULE,
    REPO,
    SKYPILOT_TASKS,
    clean_env,
    credential_findings,
    dockerfile_instructions,
    effective_env,
    entrypoint_dry_run,
    find_checkov,
    job_spec,
    k8s_object,
    kustomize_build,
    launcher_arguments,
    option,
    pod_spec,
    pod_template,
    shutdown_timeout,
    trainer_container,
    yaml_docs,
)

PREEMPTED = 75
TRAINER = REPO / "examples" / "train.py"
GPU = "nvidia.com/gpu"


def _docs(variant: str) -> list[dict[str, Any]]:
    """The objects `kubectl apply -k deploy/k8s/CLOUD/VARIANT` creates."""
    return kustomize_build(K8S_VARIANTS[variant])


def _cloud(variant: str) -> str:
    return variant.split("-")[0]


def _multinode(variant: str) -> bool:
    return variant.split("-")[1] == "multinode"


def _base(variant: str) -> Path:
    """The folder the overlay builds on: the Job's base, or the JobSet's."""
    return K8S_VARIANTS[variant].parent / ("jobset" if _multinode(variant) else "base")


def test_preempted_exit_code_is_the_documented_one() -> None:
    from spotckpt import launch

    assert spotckpt.PREEMPTED_EXIT_CODE == PREEMPTED
    assert launch.PREEMPTED_EXIT_CODE == PREEMPTED
    assert not (DEPLOY / "launch.py").exists(), "spotckpt launch is the one launcher"


# ---- YAML ----------------------------------------------------------------------------------------


YAML_FILES = sorted(DEPLOY.rglob("*.yaml"))


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses(path: Path) -> None:
    docs = yaml_docs(path)
    assert docs and all(isinstance(d, dict) for d in docs)


@pytest.mark.parametrize("variant", K8S_VARIANTS)
def test_k8s_manifest_has_configmap_serviceaccount_and_job(variant: str) -> None:
    kinds = [d["kind"] for d in _docs(variant)]
    workload = "JobSet" if _multinode(variant) else "Job"
    for kind in ("Namespace", "ConfigMap", "ServiceAccount", workload, "NetworkPolicy"):
        assert kinds.count(kind) == 1, f"{variant}: {kind}"
    # The multi-node job replaces the single-node one; its pods meet through a headless service.
    assert kinds.count("Job") + kinds.count("JobSet") == 1
    assert kinds.count("Service") == int(_multinode(variant))
    assert "Secret" not in kinds


# ---- Kubernetes: restart on preemption -----------------------------------------------------------


@pytest.mark.parametrize("variant", [v for v in K8S_VARIANTS if not _multinode(v)])
def test_k8s_job_restarts_on_preemption_without_spending_retries(variant: str) -> None:
    docs = _docs(variant)
    job = k8s_object(docs, "Job")["spec"]
    # podFailurePolicy needs restartPolicy Never; the Job controller makes the new pod.
    assert pod_spec(docs)["restartPolicy"] == "Never"
    assert isinstance(job["backoffLimit"], int) and job["backoffLimit"] >= 1
    rules = job["podFailurePolicy"]["rules"]
    disrupted = [
        r
        for r in rules
        if any(c["type"] == "DisruptionTarget" for c in r.get("onPodConditions", []))
    ]
    assert [r["action"] for r in disrupted] == ["Ignore"]
    by_code = [r for r in rules if "onExitCodes" in r]
    assert len(by_code) == 1
    codes = by_code[0]["onExitCodes"]
    assert by_code[0]["action"] == "Ignore"
    assert codes["operator"] == "In" and codes["values"] == [spotckpt.PREEMPTED_EXIT_CODE]
    assert codes["containerName"] == trainer_container(docs)["name"]
    # The exit-code rule must come before any rule that fails or counts the same pod.
    assert rules.index(by_code[0]) == min(
        i for i, r in enumerate(rules) if "onExitCodes" in r or r["action"] != "Ignore"
    )


SPOT_SELECTORS = {
    "eks": ("eks.amazonaws.com/capacityType", "SPOT"),
    "gke": ("cloud.google.com/gke-spot", "true"),
    "aks": ("kubernetes.azure.com/scalesetpriority", "spot"),
}


@pytest.mark.parametrize("variant", K8S_VARIANTS)
def test_k8s_job_lands_on_spot_nodes_and_tolerates_their_taint(variant: str) -> None:
    spec = pod_spec(_docs(variant))
    key, value = SPOT_SELECTORS[_cloud(variant)]
    assert spec["nodeSelector"][key] == value
    tolerations = {(t["key"], t.get("value"), t["effect"]) for t in spec["tolerations"]}
    assert (key, value, "NoSchedule") in tolerations


@pytest.mark.parametrize("variant", K8S_VARIANTS)
def test_k8s_bucket_uri_comes_from_the_configmap(variant: str) -> None:
    docs = _docs(variant)
    uri = k8s_object(docs, "ConfigMap")["data"]["SPOTCKPT_URI"]
    assert uri.startswith({"eks": "s3://", "gke": "gs://", "aks": "az://"}[_cloud(variant)])
    container = trainer_container(docs)
    literal = [e for e in container.get("env", []) if e["name"] == "SPOTCKPT_URI" and "value" in e]
    assert not literal, "the URI belongs in the ConfigMap"
    assert effective_env(docs)["SPOTCKPT_URI"] == uri


@pytest.mark.parametrize("variant", K8S_VARIANTS)
def test_k8s_settings_are_ones_spotckpt_accepts(
    variant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """spotckpt's Config rejects unknown SPOTCKPT_* variables: the trainer would not start."""
    for name in list(os.environ):
        if name.startswith("SPOTCKPT_"):
            monkeypatch.delenv(name)
    env = effective_env(_docs(variant))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = Config.load(cwd=tmp_path)
    assert config.uri == env["SPOTCKPT_URI"]
    assert config.save_budget_s == float(env["SPOTCKPT_SAVE_BUDGET_S"])


IDENTITY_ANNOTATIONS = {
    "eks": "eks.amazonaws.com/role-arn",
    "gke": "iam.gke.io/gcp-service-account",
    "aks": "azure.workload.identity/client-id",
}


@pytest.mark.parametrize("variant", K8S_VARIANTS)
def test_k8s_cloud_identity_without_static_keys(variant: str) -> None:
    cloud = _cloud(variant)
    docs = _docs(variant)
    account = k8s_object(docs, "ServiceAccount")
    annotation = account["metadata"]["annotations"][IDENTITY_ANNOTATIONS[cloud]]
    if cloud == "eks":
        assert re.fullmatch(r"arn:aws:iam::\d{12}:role/[\w+=,.@-]+", annotation)
    elif cloud == "aks":
        assert re.fullmatch(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", annotation)
        # Workload ID's webhook injects the token only into pods with this label.
        labels = pod_template(docs)["metadata"]["labels"]
        assert labels["azure.workload.identity/use"] == "true"
    else:
        assert re.fullmatch(r"[a-z][a-z0-9-]+@[a-z0-9-]+\.iam\.gserviceaccount\.com", annotation)
    spec = pod_spec(docs)
    assert spec["serviceAccountName"] == account["metadata"]["name"]
    container = trainer_container(docs)
    for source in container.get("envFrom", []):
        assert "secretRef" not in source
    for item in container.get("env", []):
        assert "secretKeyRef" not in item.get("valueFrom", {})
    assert not [v for v in spec.get("volumes", []) if "secret" in v]
    env = effective_env(docs)
    assert not {
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "AZURE_STORAGE_CONNECTION_STRING",
        "AZURE_STORAGE_KEY",
        "AZURE_CLIENT_SECRET",
    } & set(env)


# ---- Kubernetes: time to save, and the signal's path ---------------------------------------------


@pytest.mark.process
@pytest.mark.parametrize("variant", K8S_VARIANTS)
def test_k8s_grace_period_covers_the_save_budget(variant: str) -> None:
    """save budget <= launcher shutdown timeout; + launcher exit <= grace period."""
    docs = _docs(variant)
    env = effective_env(docs)
    budget = float(env["SPOTCKPT_SAVE_BUDGET_S"])
    timeout = shutdown_timeout(env)  # what the entry point passes to the launcher with this env
    grace = pod_spec(docs)["terminationGracePeriodSeconds"]
    assert timeout >= budget + 1, "the workers need time to exit after the save"
    assert grace >= timeout + LAUNCHER_EXIT_S
    assert grace >= budget
    if _cloud(variant) == "eks":
        assert grace < 120, "AWS reclaims a spot instance 2 minutes after the notice"
    elif _cloud(variant) == "aks":
        assert grace < 30, "Azure posts the Preempt event at least 30 s before the eviction"
    else:
        # GKE's graceful node shutdown gives regular pods the first 15 s of the 30 s notice.
        assert timeout <= 15


@pytest.mark.parametrize("variant", K8S_VARIANTS)
def test_k8s_stop_signal_goes_to_the_image_entry_point(variant: str) -> None:
    docs = _docs(variant)
    container = trainer_container(docs)
    # No command: the image's ENTRYPOINT (tini -> entrypoint.sh -> launcher) is PID 1 and gets
    # the kubelet's SIGTERM. A `sh -c` command would swallow it.
    assert "command" not in container
    assert all(isinstance(a, str) for a in container.get("args", []))
    # A preStop hook runs before SIGTERM and eats into the grace period.
    assert "preStop" not in container.get("lifecycle", {})
    assert not pod_spec(docs).get("shareProcessNamespace", False)


@pytest.mark.parametrize("variant", K8S_VARIANTS)
def test_k8s_runs_as_the_image_user(variant: str) -> None:
    docs = _docs(variant)
    security = pod_spec(docs)["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] == _dockerfile_uid()
    container = trainer_container(docs)
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


# ---- Kubernetes: the image and the training command ---------------------------------------------


def _overlay(folder: Path) -> dict[str, Any]:
    (doc,) = yaml_docs(folder / "kustomization.yaml")
    return doc


def _command_patch(overlay: dict[str, Any]) -> dict[str, Any]:
    """The overlay's JSON patch operation that sets the trainer's args (the training command)."""
    operations = [
        op
        for patch in overlay["patches"]
        if "target" in patch
        for op in yaml.safe_load(patch["patch"])
        if op["path"].endswith("/template/spec/containers/0/args")
    ]
    assert len(operations) == 1, operations
    return operations[0]


def _copied_into_image(dockerfile: Path) -> dict[str, str]:
    """Destination in the image -> source in the repository, for the Dockerfile's COPY lines."""
    copies: dict[str, str] = {}
    for word, args in dockerfile_instructions(dockerfile):
        if word == "COPY" and not args.startswith("--"):
            *sources, target = args.split()
            for source in sources:
                name = target + Path(source).name if target.endswith("/") else target
                copies[name] = source
    return copies


def _runs_the_example(command: list[str]) -> None:
    """The command is the example trainer in the base image, with options the example has."""
    assert _copied_into_image(DOCKERFILE)[command[0]] == "examples/train.py"
    options = TRAINER.read_text()
    for word in command[1:]:
        if word.startswith("--"):
            assert f'"{word}"' in options, f"examples/train.py has no {word}"


@pytest.mark.parametrize("variant", K8S_VARIANTS)
def test_k8s_image_and_command_come_from_the_overlay(variant: str) -> None:
    overlay = _overlay(K8S_VARIANTS[variant])
    (image,) = overlay["images"]
    container = trainer_container(_docs(variant))
    assert container["image"] == f"{image['newName']}:{image['newTag']}"
    operation = _command_patch(overlay)
    assert container["args"] == operation["value"]
    assert all(isinstance(a, str) for a in container["args"])
    _runs_the_example(container["args"])
    # The base names the image kustomize replaces, and leaves the command to the overlay: without
    # the patch the image's own CMD runs.
    base = trainer_container(kustomize_build(_base(variant)))
    assert base["image"].split(":")[0] == image["name"]
    assert "args" not in base and operation["op"] == "add"


@pytest.mark.process
@pytest.mark.parametrize("variant", K8S_VARIANTS)
def test_k8s_overlay_settings_reach_the_container(variant: str, tmp_path: Path) -> None:
    """What a user writes in the overlay (image, training command) is what the pod runs."""
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S, k8s)
    folder = k8s / K8S_VARIANTS[variant].relative_to(K8S)
    overlay = _overlay(folder)
    overlay["images"][0].update(newName="registry.example/team/my-trainer", newTag="7-x")
    command = ["-m", "my_trainer.main", "--epochs", "3", "--name", "a b"]
    for patch in [p for p in overlay["patches"] if "target" in p]:
        operations = yaml.safe_load(patch["patch"])
        for op in operations:
            if op["path"].endswith("/args"):
                op["value"] = command
        patch["patch"] = yaml.safe_dump(operations)
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    container = trainer_container(kustomize_build(folder))
    assert container["image"] == "registry.example/team/my-trainer:7-x"
    assert container["args"] == command
    # The entry point hands that command to the launcher unchanged.
    argv = entrypoint_dry_run({}, *command)
    assert argv[-len(command) :] == command


@pytest.mark.parametrize("variant", K8S_VARIANTS)
def test_k8s_gpu_requests_only_with_the_cuda_image(variant: str) -> None:
    docs = _docs(variant)
    container = trainer_container(docs)
    spec = pod_spec(docs)
    tag = container["image"].rsplit(":", 1)[1]
    tolerated = {t["key"] for t in spec["tolerations"]}
    if not variant.endswith("-cuda"):
        assert "cuda" not in tag
        assert GPU not in yaml.safe_dump(docs), "a CPU image has no use for a GPU"
        assert "cloud.google.com/gke-accelerator" not in spec["nodeSelector"]
        return
    assert "cuda" in tag
    resources = container["resources"]
    assert int(resources["limits"][GPU]) >= 1
    assert resources["requests"][GPU] == resources["limits"][GPU]
    assert GPU in tolerated
    dshm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"]["medium"] == "Memory" and dshm["emptyDir"]["sizeLimit"] == "8Gi"
    if _cloud(variant) == "gke":
        assert spec["nodeSelector"]["cloud.google.com/gke-accelerator"].startswith("nvidia-")


def test_k8s_gpu_requests_live_in_the_gpu_component_only() -> None:
    """The bases and the CPU overlays name no GPU; the CUDA overlays get theirs from one place."""
    naming = {p.relative_to(K8S) for p in K8S.rglob("*.yaml") if GPU in p.read_text()}
    assert naming == {
        Path("components/gpu/kustomization.yaml"),
        Path("components/gpu-jobset/kustomization.yaml"),
    }
    for variant, folder in K8S_VARIANTS.items():
        components = _overlay(folder).get("components", [])
        gpu = "../../components/gpu-jobset" if _multinode(variant) else "../../components/gpu"
        expected = [gpu] if variant.endswith("-cuda") else []
        assert components == expected, variant


# ---- Kubernetes: multi-node JobSet --------------------------------------------------------------

MULTINODE = [v for v in K8S_VARIANTS if _multinode(v)]
ZONE_LABEL = "metadata.labels['topology.kubernetes.io/zone']"
ATTEMPT_LABEL = "metadata.labels['jobset.sigs.k8s.io/restart-attempt']"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"


def _nodes(docs: list[dict[str, Any]]) -> int:
    spec = job_spec(docs)
    assert spec["completions"] == spec["parallelism"], "every node's pod runs at once"
    return int(spec["parallelism"])


def _pod_env(docs: list[dict[str, Any]], node: str = "node-a", zone: str = "zone-1") -> dict:
    """The trainer's environment in a pod on `node` in `zone`, JobSet restart attempt 0."""
    fields = {"spec.nodeName": node, ZONE_LABEL: zone, ATTEMPT_LABEL: "0"}
    return effective_env(docs, fields)


@pytest.mark.parametrize("variant", MULTINODE)
def test_multinode_restarts_the_whole_job_after_an_eviction_without_counting_it(
    variant: str,
) -> None:
    docs = _docs(variant)
    jobset = k8s_object(docs, "JobSet")
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    job = job_spec(docs)
    assert pod_spec(docs)["restartPolicy"] == "Never"
    assert job["completionMode"] == "Indexed" and _nodes(docs) >= 2
    # One pod failing fails the Job at once: the JobSet, not the Job, restarts (all pods).
    assert job["backoffLimit"] == 0
    rules = job["podFailurePolicy"]["rules"]
    disrupted = [r for r in rules if "onPodConditions" in r]
    assert [r["action"] for r in disrupted] == ["FailJob"]
    assert disrupted[0]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    (by_code,) = [r for r in rules if "onExitCodes" in r]
    assert by_code["action"] == "FailJob"
    assert by_code["onExitCodes"]["values"] == [spotckpt.PREEMPTED_EXIT_CODE]
    assert by_code["onExitCodes"]["operator"] == "In"
    assert by_code["onExitCodes"]["containerName"] == trainer_container(docs)["name"]
    # A Job failed by a podFailurePolicy rule has reason PodFailurePolicy: restart, count nothing.
    policy = jobset["spec"]["failurePolicy"]
    assert isinstance(policy["maxRestarts"], int) and policy["maxRestarts"] >= 1
    (rule,) = policy["rules"]
    assert rule["action"] == "RestartJobSetAndIgnoreMaxRestarts"
    assert rule["onJobFailureReasons"] == ["PodFailurePolicy"]
    # A crash fails the Job with BackoffLimitExceeded, which no rule names: it counts.
    assert "BackoffLimitExceeded" not in yaml.safe_dump(policy)


@pytest.mark.process
@pytest.mark.parametrize("variant", MULTINODE)
def test_multinode_rendezvous_goes_through_the_headless_service_to_pod_zero(variant: str) -> None:
    docs = _docs(variant)
    jobset = k8s_object(docs, "JobSet")
    service = k8s_object(docs, "Service")
    name = jobset["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True, "rendezvous precedes readiness"
    assert service["spec"]["selector"] == {JOBSET_NAME_LABEL: name}
    network = jobset["spec"]["network"]
    assert network["enableDNSHostnames"] is True
    assert network["subdomain"] == service["metadata"]["name"]
    (replicated,) = jobset["spec"]["replicatedJobs"]
    assert replicated["replicas"] == 1
    # What the entry point hands to torchrun in a pod of this job.
    env = _pod_env(docs)
    args = _launcher_reads(entrypoint_dry_run(env))
    assert args.nnodes == str(_nodes(docs))
    assert args.rdzv_backend == "c10d" and not args.standalone
    host, port = args.rdzv_endpoint.rsplit(":", 1)
    # JobSet's pod host names: JOBSET-REPLICATEDJOB-JOBINDEX-PODINDEX.SUBDOMAIN.
    assert host == f"{name}-{replicated['name']}-0-0.{network['subdomain']}"
    (service_port,) = service["spec"]["ports"]
    (container_port,) = trainer_container(docs)["ports"]
    assert int(port) == service_port["port"] == service_port["targetPort"]
    assert container_port["containerPort"] == int(port)
    # Each restart attempt meets in a rendezvous of its own.
    assert args.rdzv_id == f"{name}-0"
    assert (
        _launcher_reads(
            entrypoint_dry_run(
                effective_env(docs, {"spec.nodeName": "n", ZONE_LABEL: "", ATTEMPT_LABEL: "3"})
            )
        ).rdzv_id
        == f"{name}-3"
    )


@pytest.mark.parametrize("variant", K8S_VARIANTS)
def test_network_policy_allows_pod_to_pod_traffic_only_within_a_multinode_job(
    variant: str,
) -> None:
    docs = _docs(variant)
    policy = k8s_object(docs, "NetworkPolicy")["spec"]
    labels = pod_template(docs)["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    peers = [rule for rule in policy["ingress"]]
    egress_to_pods = [
        r for r in policy["egress"] if any("podSelector" in t for t in r.get("to", []))
    ]
    if not _multinode(variant):
        assert peers == [] and egress_to_pods == [], "a single pod talks to no other pod"
        return
    name = k8s_object(docs, "JobSet")["metadata"]["name"]
    job_pods = {"podSelector": {"matchLabels": {JOBSET_NAME_LABEL: name}}}
    # Every port: torchrun's rendezvous, then gloo or NCCL on ports they pick themselves.
    assert peers == [{"from": [job_pods]}]
    assert egress_to_pods == [{"to": [job_pods]}]


@pytest.mark.parametrize("variant", MULTINODE)
def test_multinode_node_id_zone_and_fast_tier_come_from_the_node(
    variant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = _docs(variant)
    container = trainer_container(docs)
    refs = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in container["env"]
        if "fieldRef" in e.get("valueFrom", {})
    }
    assert refs["SPOTCKPT_NODE"] == "spec.nodeName"
    # Node labels reach pods only from Kubernetes 1.35 (KEP-4742); the manifest says so.
    assert refs["SPOTCKPT_ZONE"] == ZONE_LABEL
    assert "1.35" in (_base(variant) / "jobset.yaml").read_text()
    # The fast tier lives on the node (a hostPath), one folder per node id, copies on a peer.
    env = _pod_env(docs, node="aks-spot-12345678-vmss000000")
    local_dir = env["SPOTCKPT_LOCAL_DIR"]
    assert local_dir.endswith("/{node}")
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    (tier,) = [n for n, path in mounts.items() if local_dir.startswith(path + "/")]
    assert volumes[tier]["hostPath"]["path"] == mounts[tier]
    # The node's folder is handed to the trainer's user before it starts.
    (owner,) = pod_spec(docs)["initContainers"]
    assert owner["command"][:2] == ["chown", f"{_dockerfile_uid()}:{_dockerfile_uid()}"]
    assert owner["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert owner["securityContext"]["allowPrivilegeEscalation"] is False
    assert owner["image"] == container["image"]
    # One pod per node, so that a copy on a peer is on another machine.
    (anti,) = pod_spec(docs)["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    # spotckpt accepts all of it as the pod sees it (the node id and zone included).
    for name in list(os.environ):
        if name.startswith("SPOTCKPT_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = Config.load(cwd=tmp_path)
    assert config.local_dir == local_dir and config.redundancy == "replicate:2"
    from spotckpt.tiers.node import node_identity

    assert node_identity(env).node == "aks-spot-12345678-vmss000000"
    assert node_identity(env).zone == "zone-1"
    assert node_identity({**env, "SPOTCKPT_ZONE": ""}).zone == "", "before 1.35: no zone"


@pytest.mark.parametrize("variant", MULTINODE)
def test_multinode_pods_are_placed_and_confined_like_the_single_node_job(variant: str) -> None:
    """checkov does not look into a JobSet's pod template: the single-node Job's checked settings
    must hold there too."""
    multi = _docs(variant)
    single = _docs(variant.replace("multinode", "cpu").replace("cpu-cuda", "cuda"))
    one, many = pod_spec(single), pod_spec(multi)
    for key in (
        "nodeSelector",
        "tolerations",
        "securityContext",
        "serviceAccountName",
        "automountServiceAccountToken",
        "terminationGracePeriodSeconds",
    ):
        assert many[key] == one[key], key
    assert pod_template(single)["metadata"]["labels"].items() <= (
        pod_template(multi)["metadata"]["labels"].items()
    )
    a, b = trainer_container(single), trainer_container(multi)
    for key in ("securityContext", "resources", "envFrom", "imagePullPolicy", "image"):
        assert a[key] == b[key], key
    for container in many["initContainers"]:
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["resources"]["limits"]


@pytest.mark.process
def test_checkov_passes_on_the_jobset_pod_templates(tmp_path: Path) -> None:
    """checkov has no checks for a JobSet: each multinode build is scanned with its JobSet
    replaced by a Job that carries the same pod template and annotations (skips included)."""
    checkov = find_checkov()
    if checkov is None:
        pytest.fail(
            f"checkov not found (`make test` installs it; or set CHECKOV): {CHECKOV_VERSION}"
        )
    for variant in MULTINODE:
        docs = []
        for doc in _docs(variant):
            if doc["kind"] == "JobSet":
                (replicated,) = doc["spec"]["replicatedJobs"]
                doc = {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "metadata": {**doc["metadata"], "name": f"{variant}-pods"},
                    "spec": replicated["template"]["spec"],
                }
            docs.append(doc)
        (tmp_path / f"{variant}.yaml").write_text(yaml.safe_dump_all(docs))
    command = [checkov, "--directory", str(tmp_path), "--framework", "kubernetes"]
    result = subprocess.run(
        [*command, "--skip-download", "--output", "json"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE", "LOG_LEVEL": "ERROR"},
        check=False,
    )
    report = json.loads(result.stdout)
    report = report[0] if isinstance(report, list) else report
    results = report["results"]
    failures = [f"{c['check_id']} {c['resource']}" for c in results["failed_checks"]]
    assert failures == [], "\n".join(failures)
    scanned = {c["resource"] for c in results["passed_checks"]}
    for variant in MULTINODE:
        assert f"Job.spotckpt.{variant}-pods" in scanned, variant
    # Every skip is one of the JobSets' own annotations, each with its reason.
    skipped = {c["check_id"] for c in results["skipped_checks"]}
    assert skipped == {"CKV_K8S_43", "CKV_K8S_25"}, skipped


@pytest.mark.process
@pytest.mark.parametrize("variant", K8S_VARIANTS)
def test_kubectl_kustomize_builds_what_the_tests_check(variant: str) -> None:
    """The tests build overlays with a subset of kustomize; the real one must agree."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: the overlays are checked with the built-in subset")
    result = subprocess.run(
        [kubectl, "kustomize", str(K8S_VARIANTS[variant])],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr

    def key(doc: dict[str, Any]) -> tuple[str, str]:
        return doc["kind"], doc["metadata"]["name"]

    real = sorted((d for d in yaml.safe_load_all(result.stdout) if d), key=key)
    assert real == sorted(_docs(variant), key=key)


# ---- SkyPilot ------------------------------------------------------------------------------------


def _task(variant: str) -> dict[str, Any]:
    (task,) = yaml_docs(SKYPILOT_TASKS[variant])
    return task


FAKE_DOCKER = """#!/bin/sh
# Records its arguments, one per line, then a separator; and the values of a few variables.
printf '%s\n' "$@" >> "$DOCKER_CALLS"
echo --- >> "$DOCKER_CALLS"
printf '%s=%s\n' LAUNCH_TORCHRUN_ARGS "${LAUNCH_TORCHRUN_ARGS:-}" SPOTCKPT_NODE \
    "${SPOTCKPT_NODE:-}" > "$DOCKER_CALLS.env"
"""
# Records what it would run as root.
FAKE_SUDO = """#!/bin/sh
printf '%s\n' "$*" >> "$SUDO_CALLS"
"""
# What SkyPilot sets on the second of two VMs.
SKYPILOT_NODE_ENV = {
    "SKYPILOT_NUM_NODES": "2",
    "SKYPILOT_NODE_RANK": "1",
    "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2",
}


def _run_task_scripts(task: dict[str, Any], tmp_path: Path, **env: str) -> list[list[str]]:
    """Run the task's setup and run scripts as SkyPilot does (envs exported), with a `docker` that
    records its calls instead of pulling or running anything."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    docker = bin_dir / "docker"
    docker.write_text(FAKE_DOCKER)
    docker.chmod(0o755)
    (bin_dir / "sudo").write_text(FAKE_SUDO)
    (bin_dir / "sudo").chmod(0o755)
    calls = tmp_path / "docker-calls"
    full = clean_env(**{k: str(v) for k, v in task["envs"].items()}, **SKYPILOT_NODE_ENV)
    full.update(
        env,
        DOCKER_CALLS=str(calls),
        SUDO_CALLS=str(tmp_path / "sudo-calls"),
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    )
    for section in ("setup", "run"):
        result = subprocess.run(
            ["bash", "-c", task[section]], env=full, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, f"{section}: {result.stderr}"
    text = calls.read_text()
    return [call.splitlines() for call in text.split("---\n") if call.strip()]


@pytest.mark.process
@pytest.mark.parametrize("variant", SKYPILOT_TASKS)
def test_skypilot_task_uses_spot_recovers_and_sets_the_uri(variant: str) -> None:
    task = _task(variant)
    resources = task["resources"]
    assert resources["use_spot"] is True
    recovery = resources["job_recovery"]
    assert recovery["strategy"] in ("FAILOVER", "EAGER_NEXT_REGION")
    assert spotckpt.PREEMPTED_EXIT_CODE in recovery["recover_on_exit_codes"]
    assert isinstance(recovery["max_restarts_on_errors"], int)
    envs = {k: str(v) for k, v in task["envs"].items()}
    assert re.match(r"(s3|gs)://[^/]+/.+", envs["SPOTCKPT_URI"])
    # The shortest notice among the clouds SkyPilot may pick is 30 s (GCE, Azure).
    assert shutdown_timeout(envs) + LAUNCHER_EXIT_S <= 30


@pytest.mark.process
@pytest.mark.parametrize("variant", SKYPILOT_TASKS)
def test_skypilot_runs_the_image_with_the_training_command(variant: str, tmp_path: Path) -> None:
    task = _task(variant)
    envs = {k: str(v) for k, v in task["envs"].items()}
    image = "registry.example/team/my-trainer:7-x"
    pull, run = _run_task_scripts(
        task, tmp_path, TRAIN_IMAGE=image, TRAIN_COMMAND="-m my_trainer.main --epochs 3"
    )
    assert pull == ["pull", image]
    assert run[0] == "run" and run.count(image) == 1
    # The image, then the training command in place of its CMD.
    assert run[run.index(image) + 1 :] == ["-m", "my_trainer.main", "--epochs", "3"]
    options = run[: run.index(image)]
    # Every spotckpt and entry-point setting reaches the container (by name: the value comes from
    # the task's environment, so none is written into the command line).
    passed = {options[i + 1] for i, w in enumerate(options) if w == "-e"}
    # Several nodes: also the node id and the rendezvous, which the run script derives.
    derived = {"SPOTCKPT_NODE", "LAUNCH_TORCHRUN_ARGS"} if "num_nodes" in task else set()
    assert passed == {n for n in envs if n.startswith(("SPOTCKPT_", "LAUNCH_"))} | derived
    assert option(options, "--network") == "host"
    stop = int(option(options, "--stop-timeout"))
    assert shutdown_timeout(envs) + LAUNCHER_EXIT_S <= stop <= 30
    # The task's defaults: the example trainer in the base image.
    _, default_run = _run_task_scripts(task, tmp_path / "defaults")
    _runs_the_example(default_run[default_run.index(envs["TRAIN_IMAGE"]) + 1 :])


@pytest.mark.process
@pytest.mark.parametrize("variant", SKYPILOT_TASKS)
def test_skypilot_gpus_only_with_the_cuda_image(variant: str, tmp_path: Path) -> None:
    task = _task(variant)
    tag = task["envs"]["TRAIN_IMAGE"].rsplit(":", 1)[1]
    (_, run) = _run_task_scripts(task, tmp_path)
    options = run[: run.index(task["envs"]["TRAIN_IMAGE"])]
    if variant != "cuda":
        assert "cuda" not in tag
        assert "accelerators" not in task["resources"]
        assert "--gpus" not in options
    else:
        assert "cuda" in tag
        assert task["resources"]["accelerators"]
        assert option(options, "--gpus") == "all"


def test_skypilot_tasks_differ_only_in_resources_and_image() -> None:
    """One task per image variant: everything but the machine, the image and the GPU flag agrees."""
    cpu, cuda = _task("cpu"), _task("cuda")
    for task in (cpu, cuda):
        del task["resources"]["cpus" if task is cpu else "accelerators"]
        task["resources"].pop("memory", None)
        task["envs"].pop("TRAIN_IMAGE")
        task["run"] = re.sub(r"^ *--gpus all --ipc host \\\n", "", task["run"], flags=re.M)
    assert cpu == cuda


def test_skypilot_multinode_task_is_the_cpu_task_on_several_nodes() -> None:
    cpu, multi = _task("cpu"), _task("multinode")
    assert multi["num_nodes"] >= 2 and "num_nodes" not in cpu
    assert multi["resources"] == cpu["resources"]
    shared = {k: v for k, v in multi["envs"].items() if k in cpu["envs"]}
    assert shared == {**cpu["envs"], "TRAIN_COMMAND": shared["TRAIN_COMMAND"]}
    assert multi["envs"]["TRAIN_COMMAND"].startswith(cpu["envs"]["TRAIN_COMMAND"])
    assert set(multi["envs"]) - set(cpu["envs"]) == {"SPOTCKPT_LOCAL_DIR", "SPOTCKPT_REDUNDANCY"}


@pytest.mark.process
def test_skypilot_multinode_rendezvous_comes_from_skypilot_node_variables(
    tmp_path: Path,
) -> None:
    task = _task("multinode")
    envs = {k: str(v) for k, v in task["envs"].items()}
    _, run = _run_task_scripts(task, tmp_path, SKYPILOT_NUM_NODES=str(task["num_nodes"]))
    passed = dict(
        line.split("=", 1) for line in (tmp_path / "docker-calls.env").read_text().splitlines()
    )
    args = _launcher_reads(
        entrypoint_dry_run({"LAUNCH_TORCHRUN_ARGS": passed["LAUNCH_TORCHRUN_ARGS"]})
    )
    # Static rendezvous on the first VM; this VM's rank as SkyPilot numbers it.
    assert args.nnodes == str(task["num_nodes"])
    assert args.node_rank == 1
    assert args.master_addr == "10.0.0.1" and args.master_port == 29400
    assert passed["SPOTCKPT_NODE"] == socket.gethostname().split(".")[0]
    # The fast tier: a folder of the VM's disk, writable by the image's user, mounted as is.
    local_dir = envs["SPOTCKPT_LOCAL_DIR"]
    base = local_dir.removesuffix("/{node}")
    assert local_dir.endswith("/{node}") and option(run, "-v") == f"{base}:{base}"
    uid = _dockerfile_uid()
    sudo = (tmp_path / "sudo-calls").read_text().splitlines()
    assert sudo == [f"mkdir -p {base}", f"chown {uid}:{uid} {base}"]
    assert envs["SPOTCKPT_REDUNDANCY"] == "replicate:2"


@pytest.mark.parametrize("variant", SKYPILOT_TASKS)
def test_skypilot_settings_are_ones_spotckpt_accepts(
    variant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith("SPOTCKPT_"):
            monkeypatch.delenv(name)
    task = _task(variant)
    for name, value in task["envs"].items():
        monkeypatch.setenv(name, str(value))
    assert Config.load(cwd=tmp_path).uri == task["envs"]["SPOTCKPT_URI"]


# ---- Dockerfile ----------------------------------------------------------------------------------


def _instructions() -> list[tuple[str, str]]:
    return list(dockerfile_instructions(DOCKERFILE))


def _dockerfile_uid() -> int:
    users = [args for word, args in _instructions() if word == "USER"]
    assert users, "no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit(), "USER by number, so that runAsNonRoot can verify it"
    return int(uid)


def test_dockerfile_has_cpu_and_cuda_bases_by_build_argument() -> None:
    instructions = _instructions()
    froms = [args for word, args in instructions if word == "FROM"]
    assert any(f.endswith("AS base-cpu") for f in froms)
    assert any(f.endswith("AS base-cuda") and "nvidia/cuda:" in f for f in froms)
    assert froms[-1] == "base-${VARIANT}"
    assert ("ARG", "VARIANT=cpu") in instructions
    for f in froms[:-1]:
        image = f.split()[0]
        assert ":" in image and not image.endswith(":latest"), f"pin a tag: {f}"


def test_dockerfile_runs_as_non_root_and_installs_the_package() -> None:
    assert _dockerfile_uid() != 0
    runs = " ".join(args for word, args in _instructions() if word == "RUN")
    assert re.search(r"pip install [^&]*\"torch==\$\{TORCH_VERSION\}\"", runs)
    assert re.search(r"pip install -c /src/constraints.txt /src\b", runs)
    # Every COPY source exists in the repository (the build context is the repository root).
    for word, args in _instructions():
        if word == "COPY" and not args.startswith("--from"):
            for source in args.split()[:-1]:
                assert (REPO / source).exists(), f"COPY source {source} missing"


@pytest.mark.process
def test_dockerfile_stop_signal_reaches_the_trainer() -> None:
    instructions = dict(_instructions())
    entrypoint = json.loads(instructions["ENTRYPOINT"])  # exec form: no shell in between
    assert entrypoint[0].endswith("/tini") and entrypoint[1] == "--"
    assert "-g" not in entrypoint, "the launcher forwards to the workers; tini -g would double it"
    assert entrypoint[-1] == "/opt/spotckpt/entrypoint.sh"
    stop_signal = instructions.get("STOPSIGNAL", "SIGTERM")
    handled = _launcher_reads(entrypoint_dry_run({})).signals_to_handle.split(",")
    assert stop_signal in handled
    assert {"SIGTERM", "SIGUSR1"} <= set(handled)
    # The entry point replaces itself with the launcher rather than running it as a child.
    code = [
        line.strip()
        for line in ENTRYPOINT.read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    assert code[-1] == 'exec "${cmd[@]}"'


def test_dockerfile_default_command_is_the_example_trainer() -> None:
    command = json.loads(dict(_instructions())["CMD"])  # exec form: the entry point's arguments
    assert command == ["/opt/spotckpt/train.py"]
    _runs_the_example(command)


def test_dockerfile_keeps_torch_in_images_built_from_it() -> None:
    """A `pip install` in an image FROM the base must not swap its torch (CPU wheel, version)."""
    instructions = _instructions()
    settings = " ".join(args for word, args in instructions if word == "ENV")
    found = re.search(r"\bPIP_CONSTRAINT=(\S+)", settings)
    assert found, "no PIP_CONSTRAINT"
    runs = " ".join(args for word, args in instructions if word == "RUN")
    assert f'echo "torch==${{TORCH_VERSION}}" > {found.group(1)}' in runs


@pytest.mark.process
def test_trainer_dockerfile_builds_on_the_base_with_its_own_command() -> None:
    """deploy/Dockerfile.trainer, the documented path: FROM the base, COPY the code, CMD."""
    instructions = list(dockerfile_instructions(DOCKERFILE_TRAINER))
    base_text = DOCKERFILE.read_text()
    assert ("ARG", "BASE=spotckpt:cpu") in instructions
    assert "-t spotckpt:cpu ." in base_text and "-t spotckpt:cuda ." in base_text
    assert "--build-arg BASE=spotckpt:cuda" in DOCKERFILE_TRAINER.read_text()
    assert [args for word, args in instructions if word == "FROM"] == ["${BASE}"]
    assert "ENTRYPOINT" not in dict(instructions), "the base's entry point must stay"
    users = [args for word, args in instructions if word == "USER"]
    uid = _dockerfile_uid()
    assert users[-1] == f"{uid}:{uid}"
    copies = _copied_into_image(DOCKERFILE_TRAINER)
    for source in copies.values():
        assert (REPO / source).exists(), f"COPY source {source} missing"
    command = json.loads(dict(instructions)["CMD"])
    assert copies[command[0]] == "examples/train.py"
    argv = entrypoint_dry_run({}, str(REPO / copies[command[0]]), *command[1:])
    assert argv[-len(command) :] == [str(REPO / copies[command[0]]), *command[1:]]


# ---- the entry point: dry runs -------------------------------------------------------------------


@pytest.mark.process
def test_entrypoint_derives_the_shutdown_timeout_from_the_save_budget() -> None:
    assert shutdown_timeout({}) == 25 + 5  # the trainer's default budget + the default margin
    assert shutdown_timeout({"SPOTCKPT_SAVE_BUDGET_S": "60"}) == 65
    assert shutdown_timeout({"SPOTCKPT_SAVE_BUDGET_S": "12.5", "LAUNCH_EXIT_MARGIN_S": "2"}) == 15
    assert shutdown_timeout({"SPOTCKPT_SAVE_BUDGET_S": "10.0", "LAUNCH_EXIT_MARGIN_S": "0"}) == 10


@pytest.mark.process
def test_entrypoint_command_runs_the_trainer_under_the_launcher() -> None:
    script = str(TRAINER)
    cmd = entrypoint_dry_run(
        {"LAUNCH_TRAIN_SCRIPT": script, "LAUNCH_NPROC_PER_NODE": "4", "LAUNCH_PYTHON": "py"},
        "--steps",
        "7",
        "--save-every",
        "a b",
    )
    assert cmd[:3] == ["py", *LAUNCHER_MODULE]
    assert "--standalone" in cmd and "--max-restarts=0" in cmd
    assert option(cmd, "--nproc-per-node") == "4"
    assert cmd[cmd.index(script) :] == [script, "--steps", "7", "--save-every", "a b"]
    # What the launcher makes of it: the entry point's timeout, the launcher's signal list.
    args = _launcher_reads(cmd)
    assert args.shutdown_timeout == shutdown_timeout({})
    assert args.signals_to_handle.split(",") == list(FORWARDED_SIGNALS)


def _launcher_reads(argv: list[str]) -> argparse.Namespace:
    """The entry point's command as `spotckpt launch` parses it (torchrun's parser and defaults)."""
    from spotckpt.launch import parse_launch_args

    return parse_launch_args(launcher_arguments(argv))


def _program_reads(argv: list[str]) -> tuple[bool, str, list[str]]:
    """(module?, script or module, its arguments) as the launcher parses its arguments."""
    args = _launcher_reads(argv)
    return args.module, args.training_script, args.training_script_args


@pytest.mark.process
def test_entrypoint_runs_the_training_command_it_is_given() -> None:
    """The arguments (the image's CMD, Kubernetes args) are a script or -m MODULE, then its
    arguments; options alone go to the default script."""
    default = str(ANY_SCRIPT)
    env = {"LAUNCH_TRAIN_SCRIPT": default}
    script = str(TRAINER)
    assert _program_reads(entrypoint_dry_run(env, script, "--steps", "7", "a b")) == (
        False,
        script,
        ["--steps", "7", "a b"],
    )
    assert _program_reads(entrypoint_dry_run(env, "-m", "my_trainer.main", "--epochs", "3")) == (
        True,
        "my_trainer.main",
        ["--epochs", "3"],
    )
    assert _program_reads(entrypoint_dry_run(env, "--steps", "7")) == (
        False,
        default,
        ["--steps", "7"],
    )
    assert _program_reads(entrypoint_dry_run(env)) == (False, default, [])


@pytest.mark.process
@pytest.mark.parametrize(
    "args", [["/nonexistent/train.py", "--steps", "1"], ["-m"]], ids=["no-such-script", "no-module"]
)
def test_entrypoint_rejects_bad_commands(args: list[str]) -> None:
    full = clean_env(LAUNCH_DRY_RUN="1", LAUNCH_NPROC_PER_NODE="1")
    result = subprocess.run(
        ["bash", str(ENTRYPOINT), *args], env=full, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert "entrypoint:" in result.stderr


@pytest.mark.process
@pytest.mark.parametrize(
    "env",
    [
        {"SPOTCKPT_SAVE_BUDGET_S": "soon"},
        {"SPOTCKPT_SAVE_BUDGET_S": "-5"},
        {"LAUNCH_EXIT_MARGIN_S": "1e3"},
        {"LAUNCH_NPROC_PER_NODE": "0"},
        {"LAUNCH_TRAIN_SCRIPT": "/nonexistent/train.py"},
    ],
)
def test_entrypoint_rejects_bad_settings(env: dict[str, str]) -> None:
    full = clean_env(LAUNCH_DRY_RUN="1", LAUNCH_NPROC_PER_NODE="1")
    full.update(env)
    result = subprocess.run(
        ["bash", str(ENTRYPOINT)], env=full, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert "entrypoint:" in result.stderr


# ---- the entry point: real runs under the launcher -----------------------------------------------

FAKE_WORKER = """
import os, signal, sys, time
from pathlib import Path

out = Path(os.environ["FAKE_WORKER_DIR"])


def stop(signum, frame):
    (out / "signal").write_text(signal.Signals(signum).name)
    sys.exit(75)


signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGUSR1, stop)
# Written whole and then renamed: a signal that lands mid-write must not leave an empty file.
(out / "ready.tmp").write_text(str(os.getpid()))
os.replace(out / "ready.tmp", out / "ready")
if sys.argv[1] == "--exit":
    sys.exit(int(sys.argv[2]))
time.sleep(120)
sys.exit(0)
"""


def _start(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["bash", str(ENTRYPOINT), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _wait_for(predicate: Any, timeout: float, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            pytest.fail(f"entry point exited {proc.returncode} early:\n{out[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s")
        time.sleep(0.1)


def _kill_tree(proc: subprocess.Popen[str], pid_files: list[Path]) -> None:
    """Clean-up after a failure: the launcher's group, then each worker's own session."""
    written = [p.read_text() for p in pid_files if p.exists()]
    for group in [proc.pid] + [int(text) for text in written if text]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.fixture
def fake_worker(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    script = tmp_path / "worker.py"
    script.write_text(FAKE_WORKER)
    env = clean_env(
        LAUNCH_PYTHON=sys.executable,
        LAUNCH_TRAIN_SCRIPT=str(script),
        LAUNCH_NPROC_PER_NODE="1",
        SPOTCKPT_SAVE_BUDGET_S="5",
        FAKE_WORKER_DIR=str(tmp_path),
    )
    yield tmp_path, env


@pytest.mark.process
@pytest.mark.parametrize(("worker_status", "expected"), [(0, 0), (PREEMPTED, PREEMPTED), (3, 3)])
def test_entrypoint_exit_status_follows_the_worker(
    fake_worker: tuple[Path, dict[str, str]], worker_status: int, expected: int
) -> None:
    """torchrun alone exits 1 for any worker failure; the launcher passes the worker's on."""
    folder, env = fake_worker
    # The training command names the script, as an image's CMD does.
    proc = _start(env, str(folder / "worker.py"), "--exit", str(worker_status))
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        _kill_tree(proc, [folder / "ready"])
    assert proc.returncode == expected, out[-4000:]


@pytest.mark.process
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=lambda s: s.name)
def test_stop_signal_to_the_entrypoint_reaches_the_worker(
    fake_worker: tuple[Path, dict[str, str]], signum: signal.Signals
) -> None:
    folder, env = fake_worker
    proc = _start(env, "--sleep")  # options only: the default script (LAUNCH_TRAIN_SCRIPT)
    try:
        _wait_for((folder / "ready").exists, 90, proc)
        proc.send_signal(signum)
        out, _ = proc.communicate(timeout=60)
    finally:
        _kill_tree(proc, [folder / "ready"])
    assert (folder / "signal").read_text() == signum.name, out[-4000:]
    assert proc.returncode == PREEMPTED, out[-4000:]


# The real trainer runs inside this wrapper so that the test can see its own exit status (the
# launcher reports 75 for any stop by signal). The trainer stays in the wrapper's process group,
# which is the one the launcher signals, so it gets the signal exactly as it would without it.
STATUS_WRAPPER = """
import os, signal, subprocess, sys
from pathlib import Path

out = Path(os.environ["TRAINER_STATUS_DIR"])
for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
    signal.signal(signum, lambda *_: None)  # the trainer acts on it; this only waits
(out / "wrapper.pid").write_text(str(os.getpid()))
status = subprocess.call([sys.executable, {trainer!r}, *sys.argv[1:]])
(out / "trainer.status").write_text(str(status))
sys.exit(status if status >= 0 else 128 - status)
"""


def _manifest_steps(root: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in root.glob("step-*/manifest.json"))


@pytest.mark.process
@pytest.mark.parametrize("loader_workers", [0, 2], ids=lambda n: f"{n}-loader-workers")
def test_sigterm_to_the_entrypoint_makes_the_trainer_save_and_exit_75(
    tmp_path: Path, loader_workers: int
) -> None:
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(STATUS_WRAPPER.format(trainer=str(TRAINER)))
    budget = 20
    env = clean_env(
        SPOTCKPT_URI=checkpoints.as_uri(),
        SPOTCKPT_SAVE_BUDGET_S=str(budget),
        LAUNCH_PYTHON=sys.executable,
        LAUNCH_TRAIN_SCRIPT=str(wrapper),
        LAUNCH_NPROC_PER_NODE="1",
        TRAINER_STATUS_DIR=str(tmp_path),
    )
    args = ["--steps", "100000", "--save-every", "5", "--step-delay", "0.05"]
    proc = _start(env, *args, "--workers", str(loader_workers))
    try:
        _wait_for(lambda: bool(_manifest_steps(checkpoints)), 180, proc)
        before = _manifest_steps(checkpoints)
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        out, _ = proc.communicate(timeout=budget + 60)
        took = time.monotonic() - started
    finally:
        _kill_tree(proc, [tmp_path / "wrapper.pid"])
    after = _manifest_steps(checkpoints)
    status_file = tmp_path / "trainer.status"
    trainer_status = int(status_file.read_text()) if status_file.exists() else None
    assert trainer_status == PREEMPTED, f"trainer exited {trainer_status}:\n{out[-6000:]}"
    assert proc.returncode == PREEMPTED, out[-6000:]
    assert after[-1] > before[-1], f"no newer checkpoint: {before} -> {after}\n{out[-6000:]}"
    assert took < shutdown_timeout({"SPOTCKPT_SAVE_BUDGET_S": str(budget)}) + LAUNCHER_EXIT_S


# ---- credentials ---------------------------------------------------------------------------------


def test_no_credentials_in_deploy() -> None:
    assert credential_findings(DEPLOY) == []
