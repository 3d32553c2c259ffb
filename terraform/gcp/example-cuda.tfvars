# Example values for NVIDIA GPUs: a CUDA image on GPU Spot VMs. Copy to terraform.tfvars and edit.
# The GPU settings go together (the variables' validations refuse a mix): image_variant "cuda" for
# an image built FROM spotckpt:cuda, a machine type with GPUs, and their count. For an N1 machine
# type with attached GPUs, also set accelerator_type (e.g. nvidia-tesla-t4).
# No credentials belong here; terraform takes them from the environment.
name        = "spotckpt-train"
project_id  = "my-project"
region      = "us-central1"
zone        = "us-central1-a"
bucket_name = "my-spotckpt-checkpoints"
run_prefix  = "runs/exp1"
# Comes with one L4 GPU.
machine_type = "g2-standard-8"
subnetwork   = "projects/my-project/regions/us-central1/subnetworks/training"
# The image: spotckpt:cuda as pushed (the example trainer), or your trainer built FROM it.
container_image = "us-docker.pkg.dev/my-project/spotckpt/spotckpt:0.1.0-cuda"
image_variant   = "cuda"
# Grants the service account read access on this repository only.
artifact_registry_repository = "projects/my-project/locations/us/repositories/spotckpt"
# The training command in place of the image's CMD; [] runs the image's CMD.
train_command     = ["/opt/spotckpt/train.py", "--steps", "100000", "--save-every", "200"]
accelerator_count = 1
save_budget_s     = 18
# Let the GKE service account of deploy/k8s/gke/base/spotckpt.yaml act as the service account; "" to skip.
gke_workload_identity = "spotckpt/spotckpt-train"
labels                = { project = "spotckpt", owner = "ml-platform" }
