variable "name" {
  description = "Name prefix for every resource (identity, scale set)."
  type        = string
  default     = "spotckpt-train"
}

variable "resource_group_name" {
  description = "Resource group created for the storage account, the identity and the scale set."
  type        = string
}

variable "location" {
  description = "Azure region of every resource."
  type        = string
  default     = "eastus"
}

variable "storage_account_name" {
  description = "Globally unique storage account name (3-24 lower-case letters and digits)."
  type        = string
  validation {
    condition     = can(regex("^[a-z0-9]{3,24}$", var.storage_account_name))
    error_message = "storage_account_name must be 3-24 lower-case letters and digits."
  }
}

variable "replication_type" {
  description = "Storage redundancy: ZRS keeps checkpoints through the loss of a zone; GZRS also through a region's."
  type        = string
  default     = "ZRS"
  validation {
    condition     = contains(["ZRS", "GRS", "GZRS", "RAGRS", "RAGZRS"], var.replication_type)
    error_message = "replication_type must survive a zone loss: ZRS, GRS, GZRS, RAGRS or RAGZRS."
  }
}

variable "container_name" {
  description = "Blob container holding the checkpoints."
  type        = string
  default     = "checkpoints"
}

variable "run_prefix" {
  description = "Checkpoint root inside the container, without slashes at either end."
  type        = string
  default     = "runs/exp1"
  validation {
    condition     = length(var.run_prefix) > 0 && !startswith(var.run_prefix, "/") && !endswith(var.run_prefix, "/")
    error_message = "run_prefix must be a non-empty key prefix such as runs/exp1, without leading or trailing slash."
  }
}

variable "subnet_id" {
  description = "Subnet of the VMs (and of the AKS spot pool): a private one with the Microsoft.Storage service endpoint and outbound access (NAT gateway) to the registry."
  type        = string
}

variable "vm_size" {
  description = "VM size of the Spot VMs: a CPU size by default; with GPUs an N-series size (Standard_NC4as_T4_v3: one T4)."
  type        = string
  default     = "Standard_D4s_v5"
}

variable "instances" {
  description = "Number of training VMs (1 per run; 0 to stop paying once training is done)."
  type        = number
  default     = 1
}

variable "accelerator_count" {
  description = "NVIDIA GPUs per VM, those the VM size comes with; 0 for CPU VMs. More than 0 needs a CUDA image (image_variant = \"cuda\")."
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
    condition     = (var.accelerator_count > 0) == can(regex("^Standard_N", var.vm_size))
    error_message = "With accelerator_count > 0 the VM size must have GPUs (Standard_N...); with 0, a size without them."
  }
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

variable "container_registry_id" {
  description = "Resource id of the Azure Container Registry holding container_image, to grant AcrPull and log in with the managed identity; empty for a public image."
  type        = string
  default     = ""
}

variable "train_command" {
  description = "The training command in place of the image's CMD: a script in the image and its arguments, or -m MODULE and its arguments; [] runs the image's CMD."
  type        = list(string)
  default     = ["/opt/spotckpt/train.py", "--steps", "100000", "--save-every", "200"]
}

variable "save_budget_s" {
  description = "Seconds the emergency save may take. Azure posts the Scheduled Events Preempt notice at least 30 s before it evicts a Spot VM."
  type        = number
  default     = 15
  validation {
    condition     = var.save_budget_s >= 1 && var.save_budget_s <= 20
    error_message = "save_budget_s must leave room in the 30 s Preempt notice for the margins: 1 to 20."
  }
}

variable "exit_margin_s" {
  description = "Seconds for the workers to exit after the save (added to save_budget_s for the shutdown timeout of spotckpt launch, the image's launcher)."
  type        = number
  default     = 5
}

variable "os_disk_gb" {
  description = "OS disk size (the container image and caches)."
  type        = number
  default     = 100
}

variable "admin_ssh_public_key" {
  description = "SSH public key of the VMs' admin user (password login is off). A public key, not a secret."
  type        = string
}

variable "aks_cluster_id" {
  description = "Resource id of an AKS cluster to add a spot node pool to (deploy/k8s/aks); empty to skip."
  type        = string
  default     = ""
}

variable "aks_max_nodes" {
  description = "Upper bound of the AKS spot node pool's autoscaler (it scales to 0 when idle)."
  type        = number
  default     = 4
}

variable "aks_oidc_issuer_url" {
  description = "OIDC issuer URL of the AKS cluster (az aks show --query oidcIssuerProfile.issuerUrl), to let its service account act as the identity through Workload ID; empty to skip."
  type        = string
  default     = ""
}

variable "aks_service_account" {
  description = "namespace:name of the Kubernetes service account of deploy/k8s/aks/base/spotckpt.yaml."
  type        = string
  default     = "spotckpt:spotckpt-train"
}

variable "tags" {
  description = "Tags for every resource."
  type        = map(string)
  default     = { project = "spotckpt" }
}
