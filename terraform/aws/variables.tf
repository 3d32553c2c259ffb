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
  description = "Instance types the spot group may use; more types give the capacity-optimised allocation more pools."
  type        = list(string)
  default     = ["g5.xlarge", "g6.xlarge", "g4dn.xlarge"]
}

variable "ami_ssm_parameter" {
  description = "SSM parameter holding the AMI id: a GPU image with Docker and the NVIDIA container toolkit by default."
  type        = string
  default     = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-amazon-linux-2023/latest/ami-id"
}

variable "gpus" {
  description = "Whether the instances have NVIDIA GPUs to pass to the container."
  type        = bool
  default     = true
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
  description = "The image built from deploy/Dockerfile (VARIANT=cuda for GPU instances)."
  type        = string
}

variable "ecr_repository_arn" {
  description = "ARN of the ECR repository holding container_image, to grant pull rights; empty for a public image."
  type        = string
  default     = ""
}

variable "train_args" {
  description = "Arguments passed to the trainer (examples/train.py)."
  type        = list(string)
  default     = ["--steps", "100000", "--save-every", "500"]
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
  description = "Seconds for the workers to exit after the save (added to save_budget_s for torchrun's shutdown timeout)."
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
  description = "namespace/name of the Kubernetes service account for IRSA (deploy/k8s/eks.yaml)."
  type        = string
  default     = "spotckpt/spotckpt-train"
}

variable "tags" {
  description = "Tags for every resource."
  type        = map(string)
  default     = { project = "spotckpt" }
}
