# Checkpoint container, managed identity and spot capacity for spotckpt on Azure.
#   terraform init && terraform apply -var-file=example.tfvars
terraform {
  # 1.9: a variable's validation may refer to other variables (GPUs <-> CUDA image).
  required_version = ">= 1.9"
  required_providers {
    azurerm = {
      source = "hashicorp/azurerm"
      # 4.9: storage containers take storage_account_id and their id is the ARM resource id.
      # Below 5.0: 5.x renames arguments used here (the federated credential's parent_id).
      version = "~> 4.9"
    }
  }
}

# Credentials and the subscription come from the environment of whoever runs terraform (az login,
# ARM_SUBSCRIPTION_ID, a CI workload identity); none are written here.
provider "azurerm" {
  features {}
  # The storage account refuses shared keys (storage.tf): data-plane calls use Entra ID.
  storage_use_azuread = true
}
