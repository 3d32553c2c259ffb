# The training identity: a user-assigned managed identity with Storage Blob Data Contributor on
# the checkpoint container only (no account-wide or subscription role, no keys). The VMs get its
# tokens from the instance metadata service; AKS pods through Workload ID (federated credential).

resource "azurerm_user_assigned_identity" "train" {
  name                = var.name
  resource_group_name = azurerm_resource_group.train.name
  location            = azurerm_resource_group.train.location
  tags                = var.tags
}

# Read, write, delete and list blobs in this container; no account settings, no role assignments.
resource "azurerm_role_assignment" "train_blobs" {
  scope                = azurerm_storage_container.checkpoints.id
  role_definition_name = "Storage Blob Data Contributor"
  principal_id         = azurerm_user_assigned_identity.train.principal_id
  principal_type       = "ServicePrincipal"
}

# Pulling the training image from a private Azure Container Registry, when there is one.
resource "azurerm_role_assignment" "train_pull" {
  count                = var.container_registry_id == "" ? 0 : 1
  scope                = var.container_registry_id
  role_definition_name = "AcrPull"
  principal_id         = azurerm_user_assigned_identity.train.principal_id
  principal_type       = "ServicePrincipal"
}

# Workload ID for deploy/k8s/aks/base/spotckpt.yaml: only the named Kubernetes service account
# of the cluster whose OIDC issuer this is may act as the identity.
resource "azurerm_federated_identity_credential" "aks" {
  count               = var.aks_oidc_issuer_url == "" ? 0 : 1
  name                = "${var.name}-aks"
  resource_group_name = azurerm_resource_group.train.name
  parent_id           = azurerm_user_assigned_identity.train.id
  issuer              = var.aks_oidc_issuer_url
  subject             = "system:serviceaccount:${var.aks_service_account}"
  audience            = ["api://AzureADTokenExchange"]
}
