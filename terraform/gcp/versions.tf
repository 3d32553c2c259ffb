# Checkpoint bucket, least-privilege service account and Spot capacity for spotckpt on GCP.
#   terraform init && terraform apply -var-file=example.tfvars
terraform {
  # 1.9: a variable's validation may refer to other variables (GPUs <-> CUDA image).
  required_version = ">= 1.9"
  required_providers {
    google = {
      source  = "hashicorp/google"
      version = ">= 5.30"
    }
  }
}

# Credentials come from the environment of whoever runs terraform (gcloud application-default
# login, a CI workload identity); none are written here.
provider "google" {
  project = var.project_id
  region  = var.region
}
