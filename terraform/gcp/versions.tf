# Checkpoint bucket, least-privilege service account and Spot capacity for spotckpt on GCP.
#   terraform init && terraform apply -var-file=example.tfvars
terraform {
  required_version = ">= 1.5"
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
