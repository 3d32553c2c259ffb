"""Helpers for the deployment-kit tests (tests/deploy/).

Terraform modules are read with python-hcl2 and checked statically: no terraform binary and no
provider download is needed. Template files are rendered by a small subset of terraform's
`templatefile` (``${name}``, line-level ``%{ if name ~}`` / ``%{ else ~}`` / ``%{ endif ~}``),
enough for the templates in terraform/, and strict: an unknown name is an error. Likewise the
Kubernetes overlays are built by the subset of kustomize they use (resources, components, images,
JSON 6902 patches, strategic-merge deletions), for Jobs and JobSets, strict too: any other
kustomization field is an error, so no kubectl is needed (where kubectl is installed, the tests
compare with `kubectl kustomize`).
"""

from __future__ import annotations

import ast
import operator
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hcl2
import jsonpatch
import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
TERRAFORM = REPO / "terraform"
ENTRYPOINT = DEPLOY / "entrypoint.sh"
K8S = DEPLOY / "k8s"
# The overlays a user applies (`kubectl apply -k`), by cloud and variant: a single-node Job or a
# multi-node JobSet, each with the CPU or the CUDA image.
K8S_VARIANTS = {
    f"{cloud}-{variant}": K8S / cloud / variant
    for cloud in ("eks", "gke", "aks")
    for variant in ("cpu", "cuda", "multinode", "multinode-cuda")
}
SKYPILOT_TASKS = {
    "cpu": DEPLOY / "skypilot.yaml",
    "cuda": DEPLOY / "skypilot-cuda.yaml",
    "multinode": DEPLOY / "skypilot-multinode.yaml",
}
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERFILE_TRAINER = DEPLOY / "Dockerfile.trainer"

# Seconds the launcher needs to exit after its shutdown timeout; every caller's stop timeout
# (grace period, docker --stop-timeout) must exceed the shutdown timeout by at least this.
LAUNCHER_EXIT_S = 3
# How the entry point runs the launcher (`spotckpt launch`) with the interpreter it was given.
LAUNCHER_MODULE = ["-m", "spotckpt.launch"]
# An existing file that stands in for a training script in dry runs (which never run it).
ANY_SCRIPT = ENTRYPOINT

# What checkov needs: python3 -m venv .venv-checkov && .venv-checkov/bin/pip install checkov==...
CHECKOV_VERSION = "3.3.30"


# ---- HCL -----------------------------------------------------------------------------------------


def _strip(value: Any) -> Any:
    """Drop python-hcl2's markers and the quotes it keeps around keys and strings."""
    if isinstance(value, dict):
        return {
            _strip(k): _strip(v)
            for k, v in value.items()
            if k not in ("__is_block__", "__comments__", "__inline_comments__")
        }
    if isinstance(value, list):
        return [_strip(v) for v in value]
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


def load_hcl(path: Path) -> dict[str, Any]:
    """Parse one .tf or .tfvars file into plain Python values (raises on a syntax error)."""
    options_type = getattr(hcl2, "SerializationOptions", None)
    with path.open() as f:
        if options_type is not None:
            options = options_type(
                with_comments=False, explicit_blocks=False, strip_string_quotes=True
            )
            return _strip(hcl2.load(f, serialization_options=options))
        return _strip(hcl2.load(f))


@dataclass
class Module:
    """The blocks of one terraform module (a folder of .tf files), merged across its files."""

    path: Path
    resources: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    data: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    variables: dict[str, dict[str, Any]] = field(default_factory=dict)
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    locals: dict[str, Any] = field(default_factory=dict)
    providers: dict[str, dict[str, Any]] = field(default_factory=dict)

    def resource(self, type_: str, name: str) -> dict[str, Any]:
        assert (type_, name) in self.resources, f"{self.path.name}: no {type_}.{name}"
        return self.resources[(type_, name)]

    def of_type(self, type_: str) -> list[dict[str, Any]]:
        return [body for (t, _), body in self.resources.items() if t == type_]

    def defaults(self, **overrides: Any) -> dict[str, Any]:
        """Variable values: defaults, then overrides."""
        values = {n: v["default"] for n, v in self.variables.items() if "default" in v}
        values.update(overrides)
        return values


def load_module(path: Path) -> Module:
    module = Module(path)
    for tf in sorted(path.glob("*.tf")):
        doc = load_hcl(tf)
        for kind, target in (("resource", module.resources), ("data", module.data)):
            for entry in doc.get(kind, []):
                for type_, named in entry.items():
                    for name, body in named.items():
                        target[(type_, name)] = body
        for entry in doc.get("variable", []):
            module.variables.update(entry)
        for entry in doc.get("output", []):
            module.outputs.update(entry)
        for entry in doc.get("locals", []):
            module.locals.update(entry)
        for entry in doc.get("provider", []):
            module.providers.update(entry)
    return module


def blocks(body: Mapping[str, Any], name: str) -> list[dict[str, Any]]:
    """Nested blocks `name` of a block body, including `dynamic "name"` contents."""
    found = list(body.get(name, []))
    for dynamic in body.get("dynamic", []):
        if name in dynamic:
            found.extend(dynamic[name].get("content", []))
    return found


def one_block(body: Mapping[str, Any], name: str) -> dict[str, Any]:
    found = blocks(body, name)
    assert len(found) == 1, f"expected one {name} block, found {len(found)}"
    return found[0]


_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
}


def _arith(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _arith(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arith(node.left), _arith(node.right))
    raise ValueError(f"not plain arithmetic: {ast.dump(node)}")


def eval_number(expr: Any, module: Module, values: Mapping[str, Any]) -> int | float:
    """Evaluate a numeric terraform expression made of numbers, var.*, local.* and + - *."""
    if isinstance(expr, (int, float)):
        return expr
    text = str(expr)
    if text.startswith("${") and text.endswith("}"):
        text = text[2:-1]

    def ref(match: re.Match[str]) -> str:
        kind, name = match.group(1), match.group(2)
        if kind == "var":
            return repr(values[name])
        return repr(eval_number(module.locals[name], module, values))

    return _arith(ast.parse(re.sub(r"\b(var|local)\.(\w+)", ref, text), mode="eval"))


# ---- terraform templates -------------------------------------------------------------------------

# `%{ if name ~}` or `%{ if name != "" ~}`: both mean "name is set" here.
_DIRECTIVE = re.compile(r'^\s*%\{\s*(if\s+(\w+)(?:\s*!=\s*"")?|else|endif)\s*~?\}\s*$')
_INTERP = re.compile(r"(?<!\$)\$\{\s*(\w+)\s*\}")


def template_names(text: str) -> set[str]:
    """The names a template file refers to."""
    names = set(_INTERP.findall(text))
    for line in text.splitlines():
        m = _DIRECTIVE.match(line)
        if m and m.group(2):
            names.add(m.group(2))
    return names


def render_template(text: str, values: Mapping[str, Any]) -> str:
    """Render the subset of templatefile() syntax used in terraform/*/*.tftpl."""
    out: list[str] = []
    stack: list[bool] = []
    for line in text.splitlines(keepends=True):
        m = _DIRECTIVE.match(line)
        if m:
            if m.group(2):
                stack.append(bool(values[m.group(2)]))
            elif m.group(1) == "else":
                stack[-1] = not stack[-1]
            else:
                stack.pop()
            continue
        if "%{" in line:
            raise ValueError(f"unsupported template directive: {line!r}")
        if all(stack):

            def value(match: re.Match[str]) -> str:
                v = values[match.group(1)]
                return str(v).lower() if isinstance(v, bool) else str(v)

            out.append(_INTERP.sub(value, line).replace("$${", "${"))
    assert not stack, "unterminated %{ if }"
    return "".join(out)


def templatefile_arguments(expr: str) -> set[str]:
    """Top-level keys of the object passed to templatefile() in an HCL expression string."""
    start = expr.index("{", expr.index(",", expr.index("templatefile(")))
    depth, items, current = 0, [], ""
    for c in expr[start:]:
        if c in "{[(":
            depth += 1
            if depth == 1:
                continue
        elif c in "}])":
            depth -= 1
            if depth == 0:
                break
        if depth == 1 and c == ",":
            items.append(current)
            current = ""
        else:
            current += c
    items.append(current)
    return {item.split("=", 1)[0].strip() for item in items if "=" in item}


def heredoc(text: str, tag: str) -> str:
    """The body of a quoted heredoc `<<'TAG' ... TAG` in a shell script."""
    m = re.search(rf"<<'{tag}'\n(.*?)\n{tag}\n", text, re.S)
    assert m, f"no heredoc {tag}"
    return m.group(1)


def bash_syntax_ok(script: str) -> None:
    """Fail with bash's message when the script does not parse."""
    result = subprocess.run(
        ["bash", "-n"], input=script, text=True, capture_output=True, check=False
    )
    assert result.returncode == 0, result.stderr


def joined_command(script: str, *prefix: str) -> list[str]:
    """The words of the first shell command starting with `prefix` (after any `exec`),
    continuation lines joined."""
    import shlex

    joined = script.replace("\\\n", " ")
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["exec"]:
            words = words[1:]
        if words[: len(prefix)] == list(prefix):
            return words
    raise AssertionError(f"no {' '.join(prefix)} command")


def systemd_unit(text: str) -> dict[str, list[str]]:
    """Key -> values of a systemd unit file (all sections merged)."""
    unit: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "[")):
            continue
        key, _, value = line.partition("=")
        unit.setdefault(key, []).append(value)
    return unit


def option(words: list[str], name: str) -> str:
    """The value of `--name value` or `--name=value` in a word list."""
    for i, w in enumerate(words):
        if w == name:
            return words[i + 1]
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
    raise AssertionError(f"{name} not in {words}")


# ---- the entry point -----------------------------------------------------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without SPOTCKPT_*/LAUNCH_* variables, plus `extra`."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("SPOTCKPT_", "LAUNCH_", "PET_"))
    }
    env.update(extra)
    return env


def entrypoint_dry_run(env: Mapping[str, str], *args: str) -> list[str]:
    """The command deploy/entrypoint.sh would exec with `env` (one list item per argument)."""
    full = clean_env(
        LAUNCH_DRY_RUN="1",
        LAUNCH_NPROC_PER_NODE="1",
        LAUNCH_TRAIN_SCRIPT=str(ANY_SCRIPT),
    )
    full.update(env)
    result = subprocess.run(
        ["bash", str(ENTRYPOINT), *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def launcher_arguments(argv: list[str]) -> list[str]:
    """The arguments the entry point's command gives `spotckpt launch` (after the interpreter)."""
    assert argv[1:3] == LAUNCHER_MODULE, f"not the launcher: {argv}"
    return argv[3:]


def shutdown_timeout(env: Mapping[str, str]) -> int:
    """The launcher's --shutdown-timeout as the entry point derives it from `env`."""
    return int(option(launcher_arguments(entrypoint_dry_run(env)), "--shutdown-timeout"))


# ---- Kubernetes ----------------------------------------------------------------------------------


def yaml_docs(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "components", "images", "patches"}


def _kustomization(folder: Path, kind: str) -> dict[str, Any]:
    (doc,) = yaml_docs(folder / "kustomization.yaml")
    assert doc.get("kind", "Kustomization") == kind, f"{folder}: not a {kind}"
    unknown = set(doc) - KUSTOMIZATION_KEYS
    if unknown:
        raise ValueError(f"{folder}: kustomization fields this helper does not build: {unknown}")
    return doc


def _set_image(container: dict[str, Any], images: list[dict[str, Any]]) -> None:
    """kustomize's image transformer on one container: match the name without tag or digest."""
    name, _, digest = container["image"].partition("@")
    tag = ""
    if ":" in name.rsplit("/", 1)[-1]:
        name, tag = name.rsplit(":", 1)
    for image in images:
        if image["name"] == name:
            name = image.get("newName", name)
            tag = "" if "digest" in image else image.get("newTag", tag)
            digest = image.get("digest", digest)
    container["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def _pod_templates(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod templates of a Job (one) or a JobSet (one per replicated job)."""
    if doc.get("kind") == "JobSet":
        return [r["template"]["spec"]["template"] for r in doc["spec"]["replicatedJobs"]]
    template = doc.get("spec", {}).get("template")
    return [template] if template else []


def _deleted(patch: Mapping[str, Any]) -> tuple[str, str] | None:
    """(kind, name) of a strategic-merge patch that deletes one object; None for other patches."""
    if "target" in patch:
        return None
    body = yaml.safe_load(patch["patch"])
    assert body.get("$patch") == "delete", f"only JSON 6902 patches or deletions: {patch}"
    return body["kind"], body["metadata"]["name"]


def _targeted(doc: dict[str, Any], target: Mapping[str, str]) -> bool:
    assert set(target) <= {"kind", "name"}, f"unsupported patch target {target}"
    return (
        doc["kind"] == target["kind"]
        and target.get("name", doc["metadata"]["name"]) == (doc["metadata"]["name"])
    )


def _transform(docs: list[dict[str, Any]], kustomization: dict[str, Any]) -> list[dict[str, Any]]:
    """Apply a kustomization's patches, then its images, as kustomize orders them."""
    for patch in kustomization.get("patches", []):
        deleted = _deleted(patch)
        if deleted is not None:
            kept = [d for d in docs if (d["kind"], d["metadata"]["name"]) != deleted]
            assert len(kept) == len(docs) - 1, f"{deleted} to delete matches nothing"
            docs = kept
            continue
        assert set(patch) == {"target", "patch"}, f"only inline JSON 6902 patches: {patch}"
        operations = jsonpatch.JsonPatch(yaml.safe_load(patch["patch"]))
        hits = [_targeted(d, patch["target"]) for d in docs]
        assert any(hits), f"patch target {patch['target']} matches nothing"
        docs = [operations.apply(d) if hit else d for d, hit in zip(docs, hits, strict=True)]
    for doc in docs:
        for template in _pod_templates(doc):
            spec = template.get("spec", {})
            for container in [*spec.get("initContainers", []), *spec.get("containers", [])]:
                _set_image(container, kustomization.get("images", []))
    return docs


def kustomize_build(folder: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize folder` prints, for the kustomize subset deploy/k8s uses:
    resources (files, or folders with their own kustomization), then components, then this
    kustomization's patches and images."""
    kustomization = _kustomization(folder, "Kustomization")
    docs: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = folder / entry
        docs.extend(kustomize_build(path) if path.is_dir() else yaml_docs(path))
    for entry in kustomization.get("components", []):
        component = _kustomization(folder / entry, "Component")
        assert "resources" not in component, f"{entry}: component resources are not built here"
        docs = _transform(docs, component)
    return _transform(docs, kustomization)


def k8s_object(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def workload(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The one Job or JobSet of a build."""
    found = [d for d in docs if d.get("kind") in ("Job", "JobSet")]
    assert len(found) == 1, f"expected one Job or JobSet, found {[d['kind'] for d in found]}"
    return found[0]


def job_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The Job's spec, or that of the JobSet's one replicated job."""
    doc = workload(docs)
    if doc["kind"] == "Job":
        return doc["spec"]
    (replicated,) = doc["spec"]["replicatedJobs"]
    return replicated["template"]["spec"]


def pod_template(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (template,) = _pod_templates(workload(docs))
    return template


def pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return pod_template(docs)["spec"]


def trainer_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    containers = pod_spec(docs)["containers"]
    assert len(containers) == 1
    return containers[0]


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand_references(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(NAME) expansion in an env value: defined names are replaced, undefined ones
    stay as written, and $$ is a literal $."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _REFERENCE.sub(one, value)


def effective_env(
    docs: list[dict[str, Any]], fields: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The trainer container's environment as the kubelet builds it: envFrom ConfigMaps, then env
    (literal with $(NAME) expanded, ConfigMap key, or downward-API field). Field references take
    their value from `fields` (field path -> value, as the pod would see it); without `fields`
    they are left out."""
    maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d.get("kind") == "ConfigMap"}
    container = trainer_container(docs)
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert "configMapRef" in source, f"unexpected envFrom source {source}"
        env.update({k: str(v) for k, v in maps[source["configMapRef"]["name"]].items()})
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand_references(str(item["value"]), env)
        elif "fieldRef" in item["valueFrom"]:
            if fields is not None:
                env[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = item["valueFrom"]["configMapKeyRef"]
            env[item["name"]] = str(maps[ref["name"]][ref["key"]])
    return env


# ---- Dockerfile ----------------------------------------------------------------------------------


def dockerfile_instructions(path: Path = DOCKERFILE) -> Iterator[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        yield word.upper(), rest.strip()


# ---- checkov -------------------------------------------------------------------------------------


def find_checkov() -> str | None:
    """$CHECKOV, else .venv-checkov/bin/checkov in the repository, else checkov on PATH."""
    candidates = [os.environ.get("CHECKOV", ""), str(REPO / ".venv-checkov" / "bin" / "checkov")]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    return shutil.which("checkov")


# ---- credentials ---------------------------------------------------------------------------------

CREDENTIAL_PATTERNS = {
    "AWS access key id": re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),
    "private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "AWS secret variable": re.compile(
        r"AWS_(SECRET_ACCESS_KEY|ACCESS_KEY_ID|SESSION_TOKEN)|aws_(secret_access_key|access_key_id)"
    ),
    "service account key file": re.compile(
        r"GOOGLE_APPLICATION_CREDENTIALS|\"private_key\"|google_service_account_key|"
        r"aws_iam_access_key"
    ),
    "Azure account key or SAS signature": re.compile(
        r"AccountKey=|SharedAccessSignature=|[?&]sig=|\b(primary|secondary)_(access_key|connection_string)"
    ),
    "password or token value": re.compile(r"(?i)\b(password|secret|token)\s*[:=]\s*[\"']?\w{8,}"),
}


def credential_findings(root: Path) -> list[str]:
    findings = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        text = path.read_text(errors="replace")
        for what, pattern in CREDENTIAL_PATTERNS.items():
            for m in pattern.finditer(text):
                findings.append(f"{path.relative_to(REPO)}: {what}: {m.group(0)!r}")
    return findings
