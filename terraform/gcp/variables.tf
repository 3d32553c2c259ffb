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
  description = "Machine type of the Spot VMs: a CPU type by default; with GPUs an N1 type (GPUs attached: accelerator_type) or one that comes with them (g2-standard-8: one L4; a2, a3)."
  type        = string
  default     = "n2-standard-4"
}

variable "accelerator_type" {
  description = "GPU type to attach to an N1 machine type (e.g. nvidia-tesla-t4); empty for CPU VMs and for machine types that come with GPUs."
  type        = string
  default     = ""
}

variable "accelerator_count" {
  description = "NVIDIA GPUs per VM: those attached (accelerator_type) or those the machine type comes with (g2-standard-8: 1); 0 for CPU VMs. More than 0 needs a CUDA image (image_variant = \"cuda\")."
  type        = number
  default     = 0
  validation {
    condition     = var.accelerator_count >= 0 && floor(var.accelerator_count) == var.accelerator_count
    error_message = "accelerator_count must be a whole number of GPUs: 0 for CPU VMs."
  }
  validation {
    condition     = (var.accelerator_count > 0) == (var.image_variant == "cuda")
    error_message = "GPUs need a CUDA image and a CUDA image needs GPUs: set image_variant = \"cuda\" (an image built FROM spotckpt:cuda) with accelerator_count > 0, or image_variant = \"cpu\" with accelerator_count = 0."
  }
  validation {
    condition     = (var.accelerator_count > 0) == (can(regex("^(a2|a3|a4|g2|g4)-", var.machine_type)) || var.accelerator_type != "")
    error_message = "With accelerator_count > 0 the VM needs GPUs: a machine type that comes with them (g2, a2, a3, ...) or an N1 type with accelerator_type; with 0, a machine type without GPUs."
  }
  validation {
    condition     = var.accelerator_type == "" || (startswith(var.machine_type, "n1-") && var.accelerator_count > 0)
    error_message = "accelerator_type attaches accelerator_count GPUs to an N1 machine type only; other GPU machine types come with theirs (leave it empty)."
  }
}

variable "subnetwork" {
  description = "Subnetwork of the VMs: a private one with Private Google Access (and Cloud NAT if the image is outside Google's registries)."
  type        = string
}

variable "container_image" {
  description = "The training image: the spotckpt base image built from deploy/Dockerfile (runs the example), or your trainer built FROM it (deploy/Dockerfile.trainer)."
  type        = string
}

variable "image_variant" {
  description = "How container_image was built: cpu (FROM spotckpt:cpu, torch's CPU wheel) or cuda (FROM spotckpt:cuda). Must match accelerator_count."
  type        = string
  default     = "cpu"
  validation {
    condition     = contains(["cpu", "cuda"], var.image_variant)
    error_message = "image_variant must be cpu or cuda."
  }
}

variable "artifact_registry_repository" {
  description = "Artifact Registry repository holding container_image, as projects/P/locations/L/repositories/R, to grant read rights; empty for a public image."
  type        = string
  default     = ""
}

variable "train_command" {
  description = "The training command in place of the image's CMD: a script in the image and its arguments, or -m MODULE and its arguments; [] runs the image's CMD."
  type        = list(string)
  default     = ["/opt/spotckpt/train.py", "--steps", "100000", "--save-every", "200"]
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
  description = "Seconds for the workers to exit after the save (added to save_budget_s for the shutdown timeout of spotckpt launch, the image's launcher)."
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
  description = "namespace/name of a GKE service account (deploy/k8s/gke/base/spotckpt.yaml) allowed to act as the service account through Workload Identity; empty to skip."
  type        = string
  default     = ""
}

variable "labels" {
  description = "Labels for the bucket and the VMs."
  type        = map(string)
  default     = { project = "spotckpt" }
}
