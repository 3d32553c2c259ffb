# Checkpoint bucket, least-privilege identity and spot capacity for spotckpt on AWS.
#   terraform init && terraform apply -var-file=example.tfvars
terraform {
  # 1.9: a variable's validation may refer to other variables (GPUs <-> CUDA image).
  required_version = ">= 1.9"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.40"
    }
  }
}

# Credentials come from the environment of whoever runs terraform (SSO, a role, a profile);
# none are written here.
provider "aws" {
  region = var.region
  default_tags {
    tags = var.tags
  }
}
