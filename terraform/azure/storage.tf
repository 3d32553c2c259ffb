# The checkpoint container in a storage account that accepts Entra ID only (no shared keys, no
# SAS signed with them, no anonymous access), over TLS 1.2, from the training subnet only.

resource "azurerm_resource_group" "train" {
  name     = var.resource_group_name
  location = var.location
  tags     = var.tags
}

resource "azurerm_storage_account" "checkpoints" {
  #checkov:skip=CKV2_AZURE_1:Microsoft-managed keys encrypt at rest; a customer-managed key needs a Key Vault per deployment, add one if policy requires it
  #checkov:skip=CKV2_AZURE_33:The training subnet reaches the account through a service endpoint (network_rules); a private endpoint needs a private DNS zone per deployment
  #checkov:skip=CKV_AZURE_59:Public endpoint stays on but network_rules deny everything except the training subnet and Azure services
  #checkov:skip=CKV_AZURE_33:The account holds blobs only; there is no queue service to log
  #checkov:skip=CKV2_AZURE_41:Shared keys are disabled, so no SAS can be signed with them; user delegation SAS expire on their own
  #checkov:skip=CKV_AZURE_206:ZRS (the default) survives a zone loss; geo-redundant types are a variable for those who need a region loss covered too
  name                     = var.storage_account_name
  resource_group_name      = azurerm_resource_group.train.name
  location                 = azurerm_resource_group.train.location
  account_kind             = "StorageV2"
  account_tier             = "Standard"
  account_replication_type = var.replication_type
  min_tls_version          = "TLS1_2"

  https_traffic_only_enabled      = true
  shared_access_key_enabled       = false
  allow_nested_items_to_be_public = false
  local_user_enabled              = false
  default_to_oauth_authentication = true
  tags                            = var.tags

  blob_properties {
    # A deleted or overwritten blob stays 7 days as a version: a safety net against a wrong
    # `spotckpt gc` or retention setting. The management policy below removes older versions.
    versioning_enabled = true
    delete_retention_policy {
      days = 7
    }
    container_delete_retention_policy {
      days = 7
    }
  }

  network_rules {
    default_action             = "Deny"
    bypass                     = ["AzureServices"]
    virtual_network_subnet_ids = [var.subnet_id]
  }
}

resource "azurerm_storage_container" "checkpoints" {
  #checkov:skip=CKV2_AZURE_21:Blob read logging needs a Log Analytics workspace per deployment; enable diagnostic settings where one exists
  name                  = var.container_name
  storage_account_id    = azurerm_storage_account.checkpoints.id
  container_access_type = "private"
}

# What an interrupted save leaves behind: old versions here. Uncommitted blocks (a Put Block List
# that never came) are out of any lifecycle rule's reach: Azure drops them 7 days after the last
# Put Block, and `spotckpt gc` deletes the blobs that still carry them before that.
resource "azurerm_storage_management_policy" "checkpoints" {
  storage_account_id = azurerm_storage_account.checkpoints.id

  rule {
    name    = "old-versions"
    enabled = true
    filters {
      blob_types   = ["blockBlob"]
      prefix_match = ["${var.container_name}/${var.run_prefix}/"]
    }
    actions {
      version {
        delete_after_days_since_creation = 7
      }
      snapshot {
        delete_after_days_since_creation_greater_than = 7
      }
    }
  }
}
