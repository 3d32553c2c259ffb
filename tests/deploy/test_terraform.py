"""terraform/aws, terraform/gcp and terraform/azure: parse, required settings, start-up scripts,
checkov.

Offline: python-hcl2 parses the modules; no terraform binary or provider download. checkov scans
terraform/ and the deployment files (Kubernetes manifests, Dockerfile) in one run.

The commands shown in docs/deploy-azure.md are covered here (its covered-by markers).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

import spotckpt

from deploy_helpers import (
    CHECKOV_VERSION,
    DEPLOY,
    LAUNCHER_EXIT_S,
    REPO,
    TERRAFORM,
    Module,
    bash_syntax_ok,
    blocks,
    credential_findings,
    eval_number,
    find_checkov,
    heredoc,
    joined_command,
    load_hcl,
    load_module,
    one_block,
    option,
    render_template,
    shutdown_timeout,
    systemd_unit,
    template_names,
    templatefile_arguments,
)

AWS = TERRAFORM / "aws"
GCP = TERRAFORM / "gcp"
AZURE = TERRAFORM / "azure"
MODULES = [AWS, GCP, AZURE]
MODULE_IDS = ["aws", "gcp", "azure"]
HCL_FILES = sorted([*TERRAFORM.rglob("*.tf"), *TERRAFORM.rglob("*.tfvars")])


@pytest.fixture(scope="module")
def aws() -> Module:
    return load_module(AWS)


@pytest.fixture(scope="module")
def gcp() -> Module:
    return load_module(GCP)


@pytest.fixture(scope="module")
def azure() -> Module:
    return load_module(AZURE)


# ---- parsing, variables, outputs -----------------------------------------------------------------


def test_every_module_exists() -> None:
    for module in MODULES:
        assert len(list(module.glob("*.tf"))) >= 4, module
        assert (module / "example.tfvars").is_file()


@pytest.mark.parametrize("path", HCL_FILES, ids=lambda p: str(p.relative_to(TERRAFORM)))
def test_every_terraform_file_parses(path: Path) -> None:
    assert load_hcl(path)


@pytest.mark.process
def test_terraform_files_are_formatted_as_terraform_formats_them() -> None:
    """`terraform fmt` needs no provider, so it runs offline where terraform is installed
    (`terraform validate` needs the providers downloaded: run it after `terraform init`)."""
    terraform = shutil.which("terraform")
    if terraform is None:
        pytest.skip("terraform not installed: the modules are checked with python-hcl2 only")
    result = subprocess.run(
        [terraform, "fmt", "-check", "-recursive", "-list=true", str(TERRAFORM)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TF_CLI_CONFIG_FILE": os.devnull},
        check=False,
    )
    assert result.returncode == 0, f"not formatted:\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize(
    ("folder", "names"),
    [
        (AWS, {"name", "region", "instance_types", "bucket_name", "run_prefix"}),
        (GCP, {"name", "region", "zone", "machine_type", "bucket_name", "project_id"}),
        (AZURE, {"name", "location", "vm_size", "storage_account_name", "container_name"}),
    ],
    ids=MODULE_IDS,
)
def test_variables_for_names_region_and_instance_types(folder: Path, names: set[str]) -> None:
    module = load_module(folder)
    assert names <= set(module.variables)
    for name, body in module.variables.items():
        assert body.get("description"), f"variable {name} has no description"


EXAMPLES = [(folder, name) for folder in MODULES for name in ("example", "example-cuda")]


@pytest.mark.parametrize(
    ("folder", "example"), EXAMPLES, ids=[f"{f.name}-{n}" for f, n in EXAMPLES]
)
def test_example_tfvars_sets_every_required_variable_and_nothing_unknown(
    folder: Path, example: str
) -> None:
    module = load_module(folder)
    example = load_hcl(folder / f"{example}.tfvars")
    assert set(example) <= set(module.variables), set(example) - set(module.variables)
    required = {n for n, v in module.variables.items() if "default" not in v}
    assert required <= set(example), required - set(example)


@pytest.mark.parametrize(
    ("folder", "scheme"), [(AWS, "s3"), (GCP, "gs"), (AZURE, "az")], ids=MODULE_IDS
)
def test_output_is_the_checkpoint_uri(folder: Path, scheme: str) -> None:
    value = load_module(folder).outputs["checkpoint_uri"]["value"]
    assert value.startswith(f"{scheme}://${{")
    assert value.endswith("/${var.run_prefix}")


# ---- AWS: bucket ---------------------------------------------------------------------------------


def test_aws_bucket_blocks_public_access(aws: Module) -> None:
    block = aws.resource("aws_s3_bucket_public_access_block", "checkpoints")
    assert block["bucket"] == "${aws_s3_bucket.checkpoints.id}"
    for setting in (
        "block_public_acls",
        "block_public_policy",
        "ignore_public_acls",
        "restrict_public_buckets",
    ):
        assert block[setting] is True, setting
    ownership = aws.resource("aws_s3_bucket_ownership_controls", "checkpoints")
    assert one_block(ownership, "rule")["object_ownership"] == "BucketOwnerEnforced"


def test_aws_bucket_is_encrypted(aws: Module) -> None:
    config = aws.resource("aws_s3_bucket_server_side_encryption_configuration", "checkpoints")
    assert config["bucket"] == "${aws_s3_bucket.checkpoints.id}"
    rule = one_block(config, "rule")
    default = one_block(rule, "apply_server_side_encryption_by_default")
    assert default["sse_algorithm"] in ("aws:kms", "AES256")
    if default["sse_algorithm"] == "aws:kms":
        assert default["kms_master_key_id"] == "${aws_kms_key.checkpoints.arn}"
        assert aws.resource("aws_kms_key", "checkpoints")["enable_key_rotation"] is True


def test_aws_bucket_policy_denies_plain_http(aws: Module) -> None:
    policy = aws.resource("aws_s3_bucket_policy", "checkpoints")
    assert policy["policy"] == "${data.aws_iam_policy_document.bucket.json}"
    document = aws.data[("aws_iam_policy_document", "bucket")]
    tls = [
        s
        for s in blocks(document, "statement")
        if any(
            c["variable"] == "aws:SecureTransport" and c["values"] == ["false"]
            for c in blocks(s, "condition")
        )
    ]
    assert len(tls) == 1
    (deny,) = tls
    assert deny["effect"] == "Deny" and deny["actions"] == ["s3:*"]
    assert one_block(deny, "principals")["identifiers"] == ["*"]
    assert set(deny["resources"]) == {
        "${aws_s3_bucket.checkpoints.arn}",
        "${aws_s3_bucket.checkpoints.arn}/*",
    }


def test_aws_lifecycle_aborts_incomplete_multipart_uploads_after_a_day(aws: Module) -> None:
    lifecycle = aws.resource("aws_s3_bucket_lifecycle_configuration", "checkpoints")
    assert lifecycle["bucket"] == "${aws_s3_bucket.checkpoints.id}"
    aborting = [
        r for r in blocks(lifecycle, "rule") if blocks(r, "abort_incomplete_multipart_upload")
    ]
    assert len(aborting) == 1
    rule = aborting[0]
    assert rule["status"] == "Enabled"
    assert one_block(rule, "filter") == {}, "applies to the whole bucket"
    assert one_block(rule, "abort_incomplete_multipart_upload")["days_after_initiation"] == 1


# ---- AWS: identity -------------------------------------------------------------------------------


def _statements(module: Module, document: str) -> list[dict[str, Any]]:
    return blocks(module.data[("aws_iam_policy_document", document)], "statement")


def test_aws_role_has_least_privilege_on_the_run_prefix(aws: Module) -> None:
    attached = aws.resource("aws_iam_role_policy", "checkpoints")
    assert attached["role"] == "${aws_iam_role.train.id}"
    assert attached["policy"] == "${data.aws_iam_policy_document.checkpoints.json}"
    assert aws.locals["objects_arn"] == "${aws_s3_bucket.checkpoints.arn}/${var.run_prefix}/*"
    assert aws.locals["bucket_arn"] == "${aws_s3_bucket.checkpoints.arn}"
    statements = _statements(aws, "checkpoints")
    assert all(s.get("effect", "Allow") == "Allow" for s in statements)

    def granted(action: str) -> list[dict[str, Any]]:
        return [s for s in statements if action in s["actions"]]

    # Objects: read, write, delete and multipart clean-up, on the run prefix only.
    for action in (
        "s3:GetObject",
        "s3:PutObject",
        "s3:DeleteObject",
        "s3:AbortMultipartUpload",
        "s3:ListMultipartUploadParts",
    ):
        (statement,) = granted(action)
        assert statement["resources"] == ["${local.objects_arn}"], action
    # Listing: only with a prefix condition on the run prefix.
    (listing,) = granted("s3:ListBucket")
    assert listing["resources"] == ["${local.bucket_arn}"]
    (condition,) = blocks(listing, "condition")
    assert condition["variable"] == "s3:prefix" and condition["test"] == "StringLike"
    assert set(condition["values"]) == {"${var.run_prefix}", "${var.run_prefix}/*"}
    (uploads,) = granted("s3:ListBucketMultipartUploads")
    assert uploads["resources"] == ["${local.bucket_arn}"]
    # Nothing wider: no wildcard actions, and a "*" resource only for ECR's account-wide login.
    actions = [a for s in statements for a in s["actions"]]
    assert not [a for a in actions if "*" in a]
    s3_actions = {a for a in actions if a.startswith("s3:")}
    assert s3_actions == {
        "s3:GetObject",
        "s3:PutObject",
        "s3:DeleteObject",
        "s3:AbortMultipartUpload",
        "s3:ListMultipartUploadParts",
        "s3:ListBucket",
        "s3:ListBucketMultipartUploads",
    }
    for s in statements:
        if "*" in s["resources"]:
            assert s["actions"] == ["ecr:GetAuthorizationToken"]
    # The role is the only one with a policy, and nothing attaches managed policies to it.
    assert len(aws.of_type("aws_iam_role_policy")) == 1
    assert not aws.of_type("aws_iam_role_policy_attachment")
    assert not aws.of_type("aws_iam_policy_attachment")


def test_aws_instance_profile_carries_the_role_for_ec2(aws: Module) -> None:
    profile = aws.resource("aws_iam_instance_profile", "train")
    assert profile["role"] == "${aws_iam_role.train.name}"
    role = aws.resource("aws_iam_role", "train")
    assert role["assume_role_policy"] == "${data.aws_iam_policy_document.assume.json}"
    ec2 = [
        s
        for s in _statements(aws, "assume")
        if one_block(s, "principals")["identifiers"] == ["ec2.amazonaws.com"]
    ]
    assert len(ec2) == 1 and ec2[0]["actions"] == ["sts:AssumeRole"]
    template = aws.resource("aws_launch_template", "train")
    assert one_block(template, "iam_instance_profile")["arn"] == (
        "${aws_iam_instance_profile.train.arn}"
    )


# ---- AWS: spot capacity --------------------------------------------------------------------------


def test_aws_launch_template_requires_imdsv2(aws: Module) -> None:
    template = aws.resource("aws_launch_template", "train")
    metadata = one_block(template, "metadata_options")
    assert metadata["http_tokens"] == "required"
    assert metadata["http_endpoint"] == "enabled"
    # The container uses the host network, so one hop reaches IMDS.
    assert metadata["http_put_response_hop_limit"] == 1
    interface = one_block(template, "network_interfaces")
    assert interface["associate_public_ip_address"] is False
    ebs = one_block(one_block(template, "block_device_mappings"), "ebs")
    assert ebs["encrypted"] is True


def test_aws_autoscaling_group_is_spot_capacity_optimised_with_rebalance(aws: Module) -> None:
    group = aws.resource("aws_autoscaling_group", "train")
    assert group["capacity_rebalance"] is True
    policy = one_block(group, "mixed_instances_policy")
    distribution = one_block(policy, "instances_distribution")
    assert distribution["spot_allocation_strategy"] == "capacity-optimized"
    assert distribution["on_demand_base_capacity"] == 0
    assert distribution["on_demand_percentage_above_base_capacity"] == 0
    launch = one_block(policy, "launch_template")
    spec = one_block(launch, "launch_template_specification")
    assert spec["launch_template_id"] == "${aws_launch_template.train.id}"
    dynamic = [d["override"] for d in launch.get("dynamic", []) if "override" in d]
    assert dynamic and dynamic[0]["for_each"] == "${var.instance_types}"
    assert group["vpc_zone_identifier"] == "${var.subnet_ids}"


# ---- start-up scripts (AWS user data, GCP startup-script) ----------------------------------------


def _rendered(module: Module, folder: Path, template: str, expr: str, **values: Any) -> str:
    text = (folder / template).read_text()
    assert template_names(text) == templatefile_arguments(expr), "template and arguments differ"
    return render_template(text, values)


# A training command with the characters the shell quoting in compute.tf must keep intact.
ODD_COMMAND = ["-m", "my_trainer.main", "--name", "it's a b", "--glob", "*"]
# The expression both modules use to pass the command to the start-up script, quoted for the shell.
QUOTED_COMMAND = (
    'join(" ", [for a in var.train_command : format("\'%s\'", replace(a, "\'", "\'\\\\\'\'"))])'
)


def _shell_quoted(words: list[str]) -> str:
    """What QUOTED_COMMAND renders for `words`."""
    return " ".join("'" + w.replace("'", "'\\''") + "'" for w in words)


def _aws_user_data(
    aws: Module, gpus: bool, command: list[str] | None = None
) -> tuple[str, dict[str, Any]]:
    variables = aws.defaults(
        bucket_name="ckpt-bucket", container_image="registry/img:1", accelerator_count=int(gpus)
    )
    values = {
        "image": variables["container_image"],
        "ecr_registry": "123456789012.dkr.ecr.us-east-1.amazonaws.com",
        "region": variables["region"],
        "gpus": gpus,
        "checkpoint_uri": f"s3://ckpt-bucket/{variables['run_prefix']}",
        "save_budget_s": variables["save_budget_s"],
        "exit_margin_s": variables["exit_margin_s"],
        "stop_timeout_s": eval_number(aws.locals["stop_timeout_s"], aws, variables),
        "unit_stop_timeout_s": eval_number(aws.locals["unit_stop_timeout_s"], aws, variables),
        "train_command": _shell_quoted(variables["train_command"] if command is None else command),
    }
    template = aws.resource("aws_launch_template", "train")
    assert "templatefile(" in template["user_data"]
    return _rendered(aws, AWS, "user_data.sh.tftpl", template["user_data"], **values), values


def _gcp_startup(
    gcp: Module, gpus: bool, command: list[str] | None = None
) -> tuple[str, dict[str, Any]]:
    variables = gcp.defaults(
        bucket_name="ckpt-bucket", container_image="registry/img:1", accelerator_count=int(gpus)
    )
    values = {
        "image": variables["container_image"],
        "registry": "registry",
        "gpus": gpus,
        "gpu_devices": "--device /dev/nvidia0:/dev/nvidia0" if gpus else "",
        "checkpoint_uri": f"gs://ckpt-bucket/{variables['run_prefix']}",
        "save_budget_s": variables["save_budget_s"],
        "exit_margin_s": variables["exit_margin_s"],
        "stop_timeout_s": eval_number(gcp.locals["stop_timeout_s"], gcp, variables),
        "unit_stop_timeout_s": eval_number(gcp.locals["unit_stop_timeout_s"], gcp, variables),
        "train_command": _shell_quoted(variables["train_command"] if command is None else command),
    }
    template = gcp.resource("google_compute_instance_template", "train")
    expr = template["metadata"]["startup-script"]
    return _rendered(gcp, GCP, "startup.sh.tftpl", expr, **values), values


def _azure_custom_data(
    azure: Module, gpus: bool, command: list[str] | None = None, acr_login: bool = True
) -> tuple[str, dict[str, Any]]:
    variables = azure.defaults(
        storage_account_name="ckptaccount",
        container_image="registry/img:1",
        accelerator_count=int(gpus),
    )
    values = {
        "image": variables["container_image"],
        "registry": "registry",
        "acr_login": acr_login,
        "client_id": "11111111-2222-3333-4444-555555555555",
        "gpus": gpus,
        "checkpoint_uri": f"az://{variables['container_name']}/{variables['run_prefix']}",
        "save_budget_s": variables["save_budget_s"],
        "exit_margin_s": variables["exit_margin_s"],
        "stop_timeout_s": eval_number(azure.locals["stop_timeout_s"], azure, variables),
        "unit_stop_timeout_s": eval_number(azure.locals["unit_stop_timeout_s"], azure, variables),
        "train_command": _shell_quoted(variables["train_command"] if command is None else command),
    }
    scale_set = azure.resource("azurerm_linux_virtual_machine_scale_set", "train")
    assert scale_set["custom_data"].startswith("${base64encode(templatefile(")
    expr = scale_set["custom_data"]
    return _rendered(azure, AZURE, "custom_data.sh.tftpl", expr, **values), values


def _check_startup(script: str, values: dict[str, Any], notice_s: int) -> None:
    bash_syntax_ok(script)
    inner = heredoc(script, "SCRIPT")
    bash_syntax_ok(inner)
    run = joined_command(inner, "docker", "run")
    env = {w.split("=", 1)[0]: w.split("=", 1)[1] for i, w in enumerate(run) if run[i - 1] == "-e"}
    assert env["SPOTCKPT_URI"] == values["checkpoint_uri"]
    assert env["SPOTCKPT_SAVE_BUDGET_S"] == str(values["save_budget_s"])
    # The image comes right after the options, then the training command, word for word.
    assert values["image"] in run
    assert run[run.index(values["image"]) + 1 :] == shlex.split(values["train_command"])
    # Timing chain: save budget -> torchrun shutdown timeout -> docker stop -> systemd -> notice.
    timeout = shutdown_timeout(
        {
            "SPOTCKPT_SAVE_BUDGET_S": env["SPOTCKPT_SAVE_BUDGET_S"],
            **{k: v for k, v in env.items() if k.startswith("LAUNCH_")},
        }
    )
    stop = int(option(run, "--stop-timeout"))
    assert timeout > values["save_budget_s"]
    assert stop >= timeout + LAUNCHER_EXIT_S
    unit = systemd_unit(heredoc(script, "UNIT"))
    assert unit["ExecStop"] == [f"/usr/bin/docker stop --time {stop} spotckpt-train"]
    assert int(unit["TimeoutStopSec"][0]) > stop
    assert int(unit["TimeoutStopSec"][0]) <= notice_s
    # Restart crashes here; exit 75 means the machine is being reclaimed: the group replaces it.
    assert unit["Restart"] == ["on-failure"]
    assert unit["RestartPreventExitStatus"] == [str(spotckpt.PREEMPTED_EXIT_CODE)]
    assert "--network" in run and option(run, "--network") == "host"


@pytest.mark.process
@pytest.mark.parametrize("gpus", [True, False], ids=["gpu", "cpu"])
def test_aws_user_data_starts_the_container_with_the_bucket_uri(aws: Module, gpus: bool) -> None:
    script, values = _aws_user_data(aws, gpus)
    _check_startup(script, values, notice_s=120)
    run = joined_command(heredoc(script, "SCRIPT"), "docker", "run")
    assert ("--gpus" in run) is gpus
    assert "aws ecr get-login-password" in script


@pytest.mark.process
@pytest.mark.parametrize("gpus", [True, False], ids=["gpu", "cpu"])
def test_gcp_startup_script_starts_the_container_with_the_bucket_uri(
    gcp: Module, gpus: bool
) -> None:
    script, values = _gcp_startup(gcp, gpus)
    _check_startup(script, values, notice_s=30)
    assert ("cos-extensions install gpu" in script) is gpus
    run = joined_command(heredoc(script, "SCRIPT"), "docker", "run")
    assert ("/dev/nvidia0:/dev/nvidia0" in run) is gpus


@pytest.mark.process
@pytest.mark.parametrize("gpus", [True, False], ids=["gpu", "cpu"])
def test_azure_custom_data_starts_the_container_with_the_container_uri(
    azure: Module, gpus: bool
) -> None:
    script, values = _azure_custom_data(azure, gpus)
    _check_startup(script, values, notice_s=30)
    inner = heredoc(script, "SCRIPT")
    run = joined_command(inner, "docker", "run")
    assert ("--gpus" in run) is gpus
    assert ("nvidia-container-toolkit" in script) is gpus
    # DefaultAzureCredential picks the user-assigned identity by its client id (not a secret).
    assert f"AZURE_CLIENT_ID={values['client_id']}" in run
    # The registry login: tokens pass through pipes, never a process's arguments.
    (login,) = [line for line in inner.splitlines() if "docker login" in line]
    feed, _, arguments = login.partition("docker login")
    assert "--password-stdin" in arguments and "$" not in arguments.replace("${registry}", "")
    assert feed.startswith("printf ")  # a builtin: the token is in no process's arguments
    assert "access_token=%s" in inner and "--data @-" in inner
    public, _ = _azure_custom_data(azure, gpus, acr_login=False)
    assert "docker login" not in public


# ---- the image, the training command and the GPUs ------------------------------------------------


def _startup_arguments(module: Module) -> str:
    if module.path == AWS:
        return module.resource("aws_launch_template", "train")["user_data"]
    if module.path == AZURE:
        return module.resource("azurerm_linux_virtual_machine_scale_set", "train")["custom_data"]
    return module.resource("google_compute_instance_template", "train")["metadata"][
        "startup-script"
    ]


@pytest.mark.parametrize("folder", MODULES, ids=MODULE_IDS)
def test_image_and_command_reach_the_docker_run(folder: Path) -> None:
    module = load_module(folder)
    expr = _startup_arguments(module)
    assert "image = var.container_image" in expr
    assert f"train_command = {QUOTED_COMMAND}" in expr
    assert "gpus = local.gpus" in expr
    command = module.variables["train_command"]
    assert command["type"] == "${list(string)}"
    startup = {AWS: _aws_user_data, GCP: _gcp_startup, AZURE: _azure_custom_data}[folder]
    for words in (command["default"], ODD_COMMAND, []):
        script, _ = startup(module, False, words)
        run = joined_command(heredoc(script, "SCRIPT"), "docker", "run")
        assert run[run.index("registry/img:1") + 1 :] == words
    # The default is the example trainer in the base image.
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    assert f"COPY examples/train.py {command['default'][0]}" in dockerfile


CUDA_RULE = '${(var.accelerator_count > 0) == (var.image_variant == "cuda")}'


@pytest.mark.parametrize("folder", MODULES, ids=MODULE_IDS)
def test_gpus_need_a_cuda_image(folder: Path) -> None:
    """The variables refuse GPUs with a CPU image and a CUDA image without GPUs."""
    module = load_module(folder)
    variant = module.variables["image_variant"]
    assert variant["default"] == "cpu"
    (allowed,) = blocks(variant, "validation")
    assert allowed["condition"] == '${contains(["cpu", "cuda"], var.image_variant)}'
    count = module.variables["accelerator_count"]
    assert count["default"] == 0
    rules = {b["condition"]: b["error_message"] for b in blocks(count, "validation")}
    assert CUDA_RULE in rules and "CUDA image" in rules[CUDA_RULE]
    # Validations that refer to other variables need terraform 1.9.
    (settings,) = load_hcl(folder / "versions.tf")["terraform"]
    assert settings["required_version"] == ">= 1.9"
    # Everything GPU-specific follows the count.
    assert module.locals["gpus"] == "${var.accelerator_count > 0}"
    for name in ("example", "example-cuda"):
        example = load_hcl(folder / f"{name}.tfvars")
        cuda = example["image_variant"] == "cuda"
        assert (example["accelerator_count"] > 0) is cuda is (name == "example-cuda")
        assert example["container_image"].endswith("-cuda" if cuda else "-cpu")


def test_aws_instance_types_match_the_gpu_count(aws: Module) -> None:
    rule = (
        '${alltrue([for t in var.instance_types : can(regex("^[gp][0-9]", t)) '
        "== (var.accelerator_count > 0)])}"
    )
    assert rule in [
        b["condition"] for b in blocks(aws.variables["accelerator_count"], "validation")
    ]
    gpu_type = re.compile("^[gp][0-9]")
    assert not [t for t in aws.variables["instance_types"]["default"] if gpu_type.match(t)]
    cuda = load_hcl(AWS / "example-cuda.tfvars")
    assert all(gpu_type.match(t) for t in cuda["instance_types"])
    # The AMI follows: Amazon Linux for CPU instances, the Deep Learning AMI (driver) with GPUs.
    assert aws.data[("aws_ssm_parameter", "ami")]["name"] == "${local.ami_ssm_parameter}"
    ami = aws.locals["ami_ssm_parameter"]
    assert aws.variables["ami_ssm_parameter"]["default"] == ""
    gpu_ami, cpu_ami = re.findall(r'local\.gpus \? "([^"]+)" : "([^"]+)"', ami)[0]
    assert "nvidia-driver" in gpu_ami and "al2023" in cpu_ami and "nvidia" not in cpu_ami


def test_gcp_machine_type_matches_the_gpu_count(gcp: Module) -> None:
    rules = [b["condition"] for b in blocks(gcp.variables["accelerator_count"], "validation")]
    assert (
        '${(var.accelerator_count > 0) == (can(regex("^(a2|a3|a4|g2|g4)-", var.machine_type)) '
        '|| var.accelerator_type != "")}'
    ) in rules
    assert not re.match(r"^(a2|a3|a4|g2|g4|n1)-", gcp.variables["machine_type"]["default"])
    assert gcp.variables["accelerator_type"]["default"] == ""
    # GPUs are attached only when a type is named (N1); g2, a2, a3 come with theirs.
    template = gcp.resource("google_compute_instance_template", "train")
    (attached,) = [d["guest_accelerator"] for d in template["dynamic"] if "guest_accelerator" in d]
    assert attached["for_each"] == '${var.accelerator_type != "" ? [var.accelerator_type] : []}'
    assert one_block(attached, "content")["count"] == "${var.accelerator_count}"
    # One device per GPU for the container.
    assert "range(var.accelerator_count)" in gcp.locals["gpu_devices"]
    assert "gpu_devices = local.gpu_devices" in _startup_arguments(gcp)


@pytest.mark.parametrize(
    ("folder", "notice_s"), [(AWS, 120), (GCP, 30), (AZURE, 30)], ids=MODULE_IDS
)
def test_timing_fits_the_spot_notice_for_every_allowed_budget(folder: Path, notice_s: int) -> None:
    """The largest save budget the variable's validation allows still fits the cloud's notice."""
    module = load_module(folder)
    validation = one_block(module.variables["save_budget_s"], "validation")["condition"]
    top = re.search(r"var\.save_budget_s <= (\d+)", validation)
    assert top, validation
    values = module.defaults(save_budget_s=int(top.group(1)))
    assert eval_number(module.locals["unit_stop_timeout_s"], module, values) <= notice_s
    guarded = {
        GCP: ("google_compute_instance_template", "train"),
        AZURE: ("azurerm_linux_virtual_machine_scale_set", "train"),
    }
    if folder in guarded:
        template = module.resource(*guarded[folder])
        precondition = one_block(one_block(template, "lifecycle"), "precondition")
        assert precondition["condition"] == "${local.unit_stop_timeout_s <= 30}"


# ---- GCP: bucket, identity, capacity -------------------------------------------------------------


def test_gcp_bucket_uniform_access_no_public_access_and_multipart_lifecycle(gcp: Module) -> None:
    bucket = gcp.resource("google_storage_bucket", "checkpoints")
    assert bucket["uniform_bucket_level_access"] is True
    assert bucket["public_access_prevention"] == "enforced"
    aborting = [
        r
        for r in blocks(bucket, "lifecycle_rule")
        if one_block(r, "action")["type"] == "AbortIncompleteMultipartUpload"
    ]
    assert len(aborting) == 1
    assert one_block(aborting[0], "condition") == {"age": 1}


def test_gcp_service_account_has_object_access_on_that_bucket_only(gcp: Module) -> None:
    account = gcp.resource("google_service_account", "train")
    assert account["account_id"] == "${var.name}"
    (member,) = gcp.of_type("google_storage_bucket_iam_member")
    assert member["bucket"] == "${google_storage_bucket.checkpoints.name}"
    assert member["role"] in ("roles/storage.objectUser", "roles/storage.objectAdmin")
    assert member["member"] == "serviceAccount:${google_service_account.train.email}"
    # No project-wide grants, no bucket-wide admin, no keys.
    types = {t for t, _ in gcp.resources}
    assert not {t for t in types if t.startswith(("google_project_iam", "google_organization"))}
    assert "google_service_account_key" not in types
    assert not gcp.of_type("google_storage_bucket_iam_binding")


def test_gcp_spot_template_and_managed_group_restart_the_job(gcp: Module) -> None:
    template = gcp.resource("google_compute_instance_template", "train")
    scheduling = one_block(template, "scheduling")
    assert scheduling["provisioning_model"] == "SPOT"
    assert scheduling["preemptible"] is True
    assert scheduling["automatic_restart"] is False
    assert scheduling["instance_termination_action"] in ("STOP", "DELETE")
    assert template["machine_type"] == "${var.machine_type}"
    account = one_block(template, "service_account")
    assert account["email"] == "${google_service_account.train.email}"
    assert not blocks(one_block(template, "network_interface"), "access_config"), "no public IP"
    shielded = one_block(template, "shielded_instance_config")
    assert shielded["enable_secure_boot"] is True
    group = gcp.resource("google_compute_instance_group_manager", "train")
    version = one_block(group, "version")
    assert version["instance_template"].startswith("${google_compute_instance_template.train.")
    assert group["target_size"] == "${var.target_size}"
    assert one_block(group, "instance_lifecycle_policy")["default_action_on_failure"] == "REPAIR"


# ---- Azure: storage account, identity, capacity --------------------------------------------------


def test_azure_storage_account_takes_entra_id_only_over_tls_from_the_subnet(azure: Module) -> None:
    account = azure.resource("azurerm_storage_account", "checkpoints")
    assert account["shared_access_key_enabled"] is False, "no account keys, no SAS signed by them"
    assert account["allow_nested_items_to_be_public"] is False
    assert account["local_user_enabled"] is False
    assert account["https_traffic_only_enabled"] is True
    assert account["min_tls_version"] == "TLS1_2"
    assert account["account_replication_type"] == "${var.replication_type}"
    assert "LRS" not in azure.variables["replication_type"]["default"]
    rules = one_block(account, "network_rules")
    assert rules["default_action"] == "Deny"
    assert rules["virtual_network_subnet_ids"] == ["${var.subnet_id}"]
    blob = one_block(account, "blob_properties")
    assert blob["versioning_enabled"] is True
    container = azure.resource("azurerm_storage_container", "checkpoints")
    assert container["container_access_type"] == "private"
    assert container["storage_account_id"] == "${azurerm_storage_account.checkpoints.id}"
    # Without shared keys terraform itself must reach the data plane with Entra ID.
    assert azure.providers["azurerm"]["storage_use_azuread"] is True


def test_azure_lifecycle_removes_old_versions_of_the_run_prefix(azure: Module) -> None:
    policy = azure.resource("azurerm_storage_management_policy", "checkpoints")
    assert policy["storage_account_id"] == "${azurerm_storage_account.checkpoints.id}"
    (rule,) = blocks(policy, "rule")
    assert rule["enabled"] is True
    filters = one_block(rule, "filters")
    assert filters["prefix_match"] == ["${var.container_name}/${var.run_prefix}/"]
    actions = one_block(rule, "actions")
    assert one_block(actions, "version")["delete_after_days_since_creation"] == 7
    # Current blobs are spotckpt's to delete (retention, gc); no rule may expire a checkpoint.
    assert not blocks(actions, "base_blob")
    # Uncommitted blocks are beyond any lifecycle rule; the file must not pretend otherwise.
    text = (AZURE / "storage.tf").read_text()
    assert "Uncommitted blocks" in text and "spotckpt gc" in text


def test_azure_identity_is_blob_data_contributor_on_the_container_only(azure: Module) -> None:
    identity = "${azurerm_user_assigned_identity.train.principal_id}"
    grants = azure.of_type("azurerm_role_assignment")
    data = [g for g in grants if g["role_definition_name"].startswith("Storage")]
    assert len(data) == 1
    (blobs,) = data
    assert blobs["role_definition_name"] == "Storage Blob Data Contributor"
    assert blobs["scope"] == "${azurerm_storage_container.checkpoints.id}"
    assert blobs["principal_id"] == identity
    # Everything else it may do: pull the image from one registry.
    others = {g["role_definition_name"]: g["scope"] for g in grants if g is not blobs}
    assert others == {"AcrPull": "${var.container_registry_id}"}
    # Workload ID: only the named service account of the named cluster, Entra's token audience.
    federated = azure.resource("azurerm_federated_identity_credential", "aks")
    assert federated["parent_id"] == "${azurerm_user_assigned_identity.train.id}"
    assert federated["subject"] == "system:serviceaccount:${var.aks_service_account}"
    assert federated["audience"] == ["api://AzureADTokenExchange"]
    assert azure.variables["aks_service_account"]["default"] == "spotckpt:spotckpt-train"


def test_azure_spot_scale_set_deletes_evicted_vms_and_restores_them(azure: Module) -> None:
    scale_set = azure.resource("azurerm_linux_virtual_machine_scale_set", "train")
    assert scale_set["priority"] == "Spot"
    assert scale_set["eviction_policy"] == "Delete"
    assert scale_set["max_bid_price"] == -1
    assert one_block(scale_set, "spot_restore")["enabled"] is True
    assert scale_set["instances"] == "${var.instances}"
    identity = one_block(scale_set, "identity")
    assert identity["type"] == "UserAssigned"
    assert identity["identity_ids"] == ["${azurerm_user_assigned_identity.train.id}"]
    assert scale_set["disable_password_authentication"] is True
    assert scale_set["encryption_at_host_enabled"] is True
    nic = one_block(scale_set, "network_interface")
    assert not blocks(one_block(nic, "ip_configuration"), "public_ip_address"), "no public IP"
    # The AKS spot pool that deploy/k8s/aks selects: Spot, Delete, AKS's spot label and taint.
    pool = azure.resource("azurerm_kubernetes_cluster_node_pool", "spot")
    assert pool["priority"] == "Spot" and pool["eviction_policy"] == "Delete"
    assert pool["node_taints"] == ["kubernetes.azure.com/scalesetpriority=spot:NoSchedule"]
    assert pool["min_count"] == 0


# ---- credentials ---------------------------------------------------------------------------------


@pytest.mark.parametrize("folder", MODULES, ids=MODULE_IDS)
def test_providers_take_credentials_from_the_environment(folder: Path) -> None:
    module = load_module(folder)
    assert module.providers
    forbidden = {
        "access_key",
        "secret_key",
        "token",
        "credentials",
        "access_token",
        "profile",
        "client_secret",
        "client_certificate_password",
    }
    for name, body in module.providers.items():
        assert not forbidden & set(body), f"provider {name} sets {forbidden & set(body)}"
    assert not [t for t, _ in module.resources if t in ("aws_iam_access_key", "aws_iam_user")]
    leaked = [o for o in module.outputs.values() if re.search(r"access_key|connection_str", str(o))]
    assert not leaked


def test_no_credentials_in_terraform() -> None:
    assert credential_findings(TERRAFORM) == []


# ---- checkov -------------------------------------------------------------------------------------

CHECKOV_INSTALL = (
    f"python3 -m venv .venv-checkov && .venv-checkov/bin/pip install checkov=={CHECKOV_VERSION}"
)


def _json_documents(text: str) -> list[Any]:
    """checkov prints one JSON document per framework run, one after the other."""
    decoder, docs, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        doc, i = decoder.raw_decode(text, i)
        docs.extend(doc if isinstance(doc, list) else [doc])
    return docs


@pytest.mark.process
def test_checkov_passes_with_every_skip_justified() -> None:
    checkov = find_checkov()
    if checkov is None:
        pytest.fail(
            f"checkov not found (`make test` installs it; or set CHECKOV, or run: "
            f"{CHECKOV_INSTALL})"
        )
    command = [
        checkov,
        "--directory",
        "terraform",
        "--directory",
        "deploy",
        "--framework",
        "terraform",
        "kubernetes",
        "dockerfile",
        "--var-file",
        "terraform/aws/example.tfvars",
        "--var-file",
        "terraform/gcp/example.tfvars",
        "--var-file",
        "terraform/azure/example.tfvars",
        "--skip-download",  # offline: no guidelines or external checks from the platform
        "--output",
        "json",
    ]
    started = time.monotonic()
    result = subprocess.run(
        command,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE", "LOG_LEVEL": "ERROR"},
        check=False,
    )
    took = time.monotonic() - started
    reports = [r for r in _json_documents(result.stdout) if "check_type" in r]
    assert reports, f"no checkov report (exit {result.returncode}):\n{result.stderr[-4000:]}"
    by_type: dict[str, dict[str, Any]] = {}
    for report in reports:
        by_type.setdefault(report["check_type"], report)
    assert set(by_type) == {"terraform", "kubernetes", "dockerfile"}, set(by_type)

    failures, skips, files = [], [], set()
    for report in by_type.values():
        summary = report["summary"]
        assert summary["parsing_errors"] == 0, summary
        results = report["results"]
        for check in results["failed_checks"]:
            failures.append(f"{check['check_id']} {check['file_path']} {check['resource']}")
        skips.extend(results["skipped_checks"])
        files |= {c["file_path"] for c in results["passed_checks"]}
    assert failures == [], "\n".join(failures)
    assert result.returncode == 0, result.stderr[-4000:]
    # Every module and manifest was scanned, not silently passed over.
    for expected in (
        "/aws/bucket.tf",
        "/aws/compute.tf",
        "/gcp/compute.tf",
        "/azure/storage.tf",
        "/azure/compute.tf",
        "k8s/eks/base/spotckpt.yaml",
        "k8s/gke/base/spotckpt.yaml",
        "k8s/aks/base/spotckpt.yaml",
        "/Dockerfile",
        "/Dockerfile.trainer",
    ):
        assert any(f.endswith(expected) for f in files), expected

    for skip in skips:
        reason = (skip.get("check_result") or {}).get("suppress_comment") or ""
        where = f"{skip['check_id']} in {skip['file_path']}"
        assert len(reason.split()) >= 5, f"skip {where} needs a reason, got {reason!r}"
        _assert_skip_is_commented(skip["check_id"], _scanned_file(skip))
    # A record for whoever reads the log: how long the scan took.
    print(f"checkov {CHECKOV_VERSION}: {took:.1f} s, {len(skips)} justified skips")


def _scanned_file(check: dict[str, Any]) -> Path:
    """The file a checkov result is about (its paths are relative to the scanned folder)."""
    relative = check["file_path"].lstrip("/")
    candidates = [Path(check.get("file_abs_path", "")), REPO / relative]
    candidates += [REPO / root / relative for root in ("terraform", "deploy")]
    found = [p for p in candidates if p.is_file() and p.is_relative_to(REPO)]
    assert found, f"cannot find {check['file_path']}"
    return found[0]


def _assert_skip_is_commented(check_id: str, path: Path) -> None:
    """The skip sits in the file with a human-readable comment next to it."""
    lines = path.read_text().splitlines()
    index = next(i for i, line in enumerate(lines) if check_id in line and "skip" in line)
    line = lines[index]
    if re.search(r"#\s*checkov:skip=", line):
        # terraform and Dockerfile: the skip is itself a comment; its reason is required above.
        assert re.search(rf"checkov:skip={check_id}:\s*\S+(\s+\S+){{4,}}", line), line
    else:
        # Kubernetes: an annotation; the comment line right above explains it.
        assert lines[index - 1].strip().startswith("#"), f"{path.name}: no comment above {line!r}"
    assert path.is_relative_to(TERRAFORM) or path.is_relative_to(DEPLOY)
