# Example values (CPU VMs, the CPU image): copy to terraform.tfvars and edit. For NVIDIA GPUs start
# from example-cuda.tfvars instead. No credentials belong here; terraform takes them from the
# environment (gcloud auth application-default login, or a CI identity).
name         = "spotckpt-train"
project_id   = "my-project"
region       = "us-central1"
zone         = "us-central1-a"
bucket_name  = "my-spotckpt-checkpoints"
run_prefix   = "runs/exp1"
machine_type = "n2-standard-4"
subnetwork   = "projects/my-project/regions/us-central1/subnetworks/training"
# The image: spotckpt:cpu as pushed (the example trainer), or your trainer built FROM it.
container_image = "us-docker.pkg.dev/my-project/spotckpt/spotckpt:0.1.0-cpu"
image_variant   = "cpu"
# Grants the service account read access on this repository only.
artifact_registry_repository = "projects/my-project/locations/us/repositories/spotckpt"
# The training command in place of the image's CMD; [] runs the image's CMD.
train_command     = ["/opt/spotckpt/train.py", "--steps", "100000", "--save-every", "200"]
accelerator_count = 0
save_budget_s     = 18
# Let the GKE service account of deploy/k8s/gke/base/spotckpt.yaml act as the service account; "" to skip.
gke_workload_identity = "spotckpt/spotckpt-train"
labels                = { project = "spotckpt", owner = "ml-platform" }
