variable "name" {
  description = "Name prefix for every resource (service account, template, group)."
  type        = string
  default     = "spotckpt-train"
}

variable "project_id" {
  description = "Google Cloud project."
  type        = string
}

variable "region" {
  description = "Region of the bucket."
  type        = string
  default     = "us-central1"
}

variable "zone" {
  description = "Zone of the managed instance group (pick one that offers the accelerator)."
  type        = string
  default     = "us-central1-a"
}

variable "bucket_name" {
  description = "Globally unique name of the checkpoint bucket."
  type        = string
}

variable "run_prefix" {
  description = "Checkpoint root inside the bucket, without slashes at either end."
  type        = string
  default     = "runs/exp1"
  validation {
    condition     = length(var.run_prefix) > 0 && !startswith(var.run_prefix, "/") && !endswith(var.run_prefix, "/")
    error_message = "run_prefix must be a non-empty key prefix such as runs/exp1, without leading or trailing slash."
  }
}

variable "machine_type" {
  description = "Machine type of the Spot VMs (g2-standard-8 comes with one L4 GPU)."
  type        = string
  default     = "g2-standard-8"
}

variable "accelerator_type" {
  description = "Extra GPU type to attach (for N1 machine types, e.g. nvidia-tesla-t4); empty for none or for machine types that come with GPUs."
  type        = string
  default     = ""
}

variable "accelerator_count" {
  description = "Number of accelerator_type GPUs to attach."
  type        = number
  default     = 0
}

variable "gpus" {
  description = "Whether the VMs have NVIDIA GPUs (installs the driver on Container-Optimized OS and passes them to the container)."
  type        = bool
  default     = true
}

variable "subnetwork" {
  description = "Subnetwork of the VMs: a private one with Private Google Access (and Cloud NAT if the image is outside Google's registries)."
  type        = string
}

variable "container_image" {
  description = "The image built from deploy/Dockerfile (VARIANT=cuda for GPU VMs)."
  type        = string
}

variable "artifact_registry_repository" {
  description = "Artifact Registry repository holding container_image, as projects/P/locations/L/repositories/R, to grant read rights; empty for a public image."
  type        = string
  default     = ""
}

variable "train_args" {
  description = "Arguments passed to the trainer (examples/train.py)."
  type        = list(string)
  default     = ["--steps", "100000", "--save-every", "200"]
}

variable "save_budget_s" {
  description = "Seconds the emergency save may take. Compute Engine stops a Spot VM 30 s after the preemption notice."
  type        = number
  default     = 18
  validation {
    condition     = var.save_budget_s >= 1 && var.save_budget_s <= 20
    error_message = "save_budget_s must leave room in the 30 s preemption notice for the margins: 1 to 20."
  }
}

variable "exit_margin_s" {
  description = "Seconds for the workers to exit after the save (added to save_budget_s for torchrun's shutdown timeout)."
  type        = number
  default     = 4
}

variable "target_size" {
  description = "Number of training VMs (1 per run; 0 to stop paying once training is done)."
  type        = number
  default     = 1
}

variable "boot_disk_gb" {
  description = "Boot disk size (the container image and caches)."
  type        = number
  default     = 100
}

variable "gke_workload_identity" {
  description = "namespace/name of a GKE service account (deploy/k8s/gke.yaml) allowed to act as the service account through Workload Identity; empty to skip."
  type        = string
  default     = ""
}

variable "labels" {
  description = "Labels for the bucket and the VMs."
  type        = map(string)
  default     = { project = "spotckpt" }
}
