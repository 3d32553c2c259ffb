# Example values: copy to terraform.tfvars and edit. No credentials belong here; terraform takes
# them from the environment (gcloud auth application-default login, or a CI identity).
name            = "spotckpt-train"
project_id      = "my-project"
region          = "us-central1"
zone            = "us-central1-a"
bucket_name     = "my-spotckpt-checkpoints"
run_prefix      = "runs/exp1"
machine_type    = "g2-standard-8"
subnetwork      = "projects/my-project/regions/us-central1/subnetworks/training"
container_image = "us-docker.pkg.dev/my-project/spotckpt/spotckpt:0.1.0-cuda"
# Grants the service account read access on this repository only.
artifact_registry_repository = "projects/my-project/locations/us/repositories/spotckpt"
train_args                   = ["--steps", "100000", "--save-every", "200"]
save_budget_s                = 18
# Let the GKE service account of deploy/k8s/gke.yaml act as the service account; "" to skip.
gke_workload_identity = "spotckpt/spotckpt-train"
labels                = { project = "spotckpt", owner = "ml-platform" }
