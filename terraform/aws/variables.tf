variable "name" {
  description = "Name prefix for every resource (role, instance profile, launch template, group)."
  type        = string
  default     = "spotckpt-train"
}

variable "region" {
  description = "AWS region for the bucket and the instances."
  type        = string
  default     = "us-east-1"
}

variable "bucket_name" {
  description = "Globally unique name of the checkpoint bucket."
  type        = string
}

variable "run_prefix" {
  description = "Checkpoint root inside the bucket, without slashes at either end; the role may touch nothing else."
  type        = string
  default     = "runs/exp1"
  validation {
    condition     = length(var.run_prefix) > 0 && !startswith(var.run_prefix, "/") && !endswith(var.run_prefix, "/") && !strcontains(var.run_prefix, "*")
    error_message = "run_prefix must be a non-empty key prefix such as runs/exp1: no leading or trailing slash, no wildcard."
  }
}

variable "instance_types" {
  description = "Instance types the spot group may use; more types give the capacity-optimised allocation more pools. CPU types by default; GPU types (g*, p*) with accelerator_count > 0."
  type        = list(string)
  default     = ["m7i.xlarge", "m6i.xlarge", "m6a.xlarge", "m5.xlarge"]
}

variable "accelerator_count" {
  description = "NVIDIA GPUs of each instance type (g5.xlarge: 1), passed to the container; 0 for CPU instances. More than 0 needs a CUDA image (image_variant = \"cuda\")."
  type        = number
  default     = 0
  validation {
    condition     = var.accelerator_count >= 0 && floor(var.accelerator_count) == var.accelerator_count
    error_message = "accelerator_count must be a whole number of GPUs: 0 for CPU instances."
  }
  validation {
    condition     = (var.accelerator_count > 0) == (var.image_variant == "cuda")
    error_message = "GPUs need a CUDA image and a CUDA image needs GPUs: set image_variant = \"cuda\" (an image built FROM spotckpt:cuda) with accelerator_count > 0, or image_variant = \"cpu\" with accelerator_count = 0."
  }
  validation {
    condition     = alltrue([for t in var.instance_types : can(regex("^[gp][0-9]", t)) == (var.accelerator_count > 0)])
    error_message = "With accelerator_count > 0 every instance type must be an NVIDIA GPU type (g4dn, g5, g6, p4d, p5, ...); with 0, none may be (they would idle their GPUs)."
  }
}

variable "ami_ssm_parameter" {
  description = "SSM parameter holding the AMI id; empty for the default: Amazon Linux 2023 for CPU instances, the AWS Deep Learning base AMI (NVIDIA driver, container toolkit) with accelerator_count > 0."
  type        = string
  default     = ""
}

variable "vpc_id" {
  description = "VPC of the instances."
  type        = string
}

variable "subnet_ids" {
  description = "Private subnets (with a NAT gateway or an S3 gateway endpoint), one per availability zone the group may use."
  type        = list(string)
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

variable "ecr_repository_arn" {
  description = "ARN of the ECR repository holding container_image, to grant pull rights; empty for a public image."
  type        = string
  default     = ""
}

variable "train_command" {
  description = "The training command in place of the image's CMD: a script in the image and its arguments, or -m MODULE and its arguments; [] runs the image's CMD."
  type        = list(string)
  default     = ["/opt/spotckpt/train.py", "--steps", "100000", "--save-every", "500"]
}

variable "save_budget_s" {
  description = "Seconds the emergency save may take. AWS reclaims a spot instance 120 s after the notice."
  type        = number
  default     = 60
  validation {
    condition     = var.save_budget_s >= 1 && var.save_budget_s <= 90
    error_message = "save_budget_s must leave room in the 120 s spot notice for the margins: 1 to 90."
  }
}

variable "exit_margin_s" {
  description = "Seconds for the workers to exit after the save (added to save_budget_s for the shutdown timeout of spotckpt launch, the image's launcher)."
  type        = number
  default     = 5
}

variable "desired_capacity" {
  description = "Number of training instances (1 per run; 0 to stop paying once training is done)."
  type        = number
  default     = 1
}

variable "root_volume_gb" {
  description = "Root volume size (the container image and caches)."
  type        = number
  default     = 100
}

variable "eks_oidc_provider_arn" {
  description = "To also let an EKS service account assume the role (IRSA): the cluster's OIDC provider ARN; empty to skip."
  type        = string
  default     = ""
}

variable "eks_service_account" {
  description = "namespace/name of the Kubernetes service account for IRSA (deploy/k8s/eks/base/spotckpt.yaml)."
  type        = string
  default     = "spotckpt/spotckpt-train"
}

variable "tags" {
  description = "Tags for every resource."
  type        = map(string)
  default     = { project = "spotckpt" }
}
