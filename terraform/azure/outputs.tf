output "checkpoint_uri" {
  description = "SPOTCKPT_URI for the trainer: the run prefix in the checkpoint container."
  value       = "az://${azurerm_storage_container.checkpoints.name}/${var.run_prefix}"
}

output "storage_account_name" {
  description = "The storage account (its blob endpoint is https://NAME.blob.core.windows.net)."
  value       = azurerm_storage_account.checkpoints.name
}

output "identity_client_id" {
  description = "Client id of the training identity: AZURE_CLIENT_ID, and the azure.workload.identity/client-id annotation in deploy/k8s/aks/base/spotckpt.yaml."
  value       = azurerm_user_assigned_identity.train.client_id
}

output "scale_set" {
  description = "The Spot VM scale set; set instances = 0 once training is done."
  value       = azurerm_linux_virtual_machine_scale_set.train.name
}
