# Spot capacity: a VM scale set of Spot VMs (eviction policy Delete, no public address, the
# training identity) whose custom data starts the job on every boot; the scale set restores
# evicted instances when capacity returns (spot_restore), and the new VM resumes from the latest
# checkpoint. Optionally an AKS spot node pool for deploy/k8s/aks.

locals {
  shutdown_timeout_s = var.save_budget_s + var.exit_margin_s
  # docker stop waits for the launcher's shutdown timeout plus its exit; all of it has to fit in
  # the 30 s between the Scheduled Events Preempt notice and the eviction.
  stop_timeout_s      = local.shutdown_timeout_s + 3
  unit_stop_timeout_s = local.stop_timeout_s + 2
  checkpoint_uri      = "az://${azurerm_storage_container.checkpoints.name}/${var.run_prefix}"
  # GPUs go with a CUDA image and a GPU VM size (the variables' validations check both).
  gpus     = var.accelerator_count > 0
  registry = split("/", var.container_image)[0]
}

resource "azurerm_linux_virtual_machine_scale_set" "train" {
  name                = var.name
  resource_group_name = azurerm_resource_group.train.name
  location            = azurerm_resource_group.train.location
  sku                 = var.vm_size
  instances           = var.instances
  tags                = var.tags

  # Spot: evicted VMs are deleted (no stopped VMs billed for their disks); -1 pays up to the
  # on-demand price, so eviction comes from capacity, not price.
  priority        = "Spot"
  eviction_policy = "Delete"
  max_bid_price   = -1
  spot_restore {
    enabled = true
    timeout = "PT1H"
  }

  admin_username                  = "spotckpt"
  disable_password_authentication = true
  admin_ssh_key {
    username   = "spotckpt"
    public_key = var.admin_ssh_public_key
  }

  source_image_reference {
    publisher = "Canonical"
    offer     = "ubuntu-24_04-lts"
    sku       = "server"
    version   = "latest"
  }

  os_disk {
    caching              = "ReadWrite"
    storage_account_type = "StandardSSD_LRS"
    disk_size_gb         = var.os_disk_gb
  }
  encryption_at_host_enabled = true
  secure_boot_enabled        = !local.gpus
  vtpm_enabled               = true

  # No public address: the subnet's NAT gateway (or firewall) reaches the registry, the storage
  # service endpoint reaches the account.
  network_interface {
    name    = "${var.name}-nic"
    primary = true
    ip_configuration {
      name      = "internal"
      primary   = true
      subnet_id = var.subnet_id
    }
  }

  identity {
    type         = "UserAssigned"
    identity_ids = [azurerm_user_assigned_identity.train.id]
  }

  # The NVIDIA driver, for GPU sizes only.
  dynamic "extension" {
    for_each = local.gpus ? ["nvidia"] : []
    content {
      name                       = "NvidiaGpuDriverLinux"
      publisher                  = "Microsoft.HpcCompute"
      type                       = "NvidiaGpuDriverLinux"
      type_handler_version       = "1.6"
      auto_upgrade_minor_version = true
    }
  }

  custom_data = base64encode(templatefile("${path.module}/custom_data.sh.tftpl", {
    image               = var.container_image
    registry            = local.registry
    acr_login           = var.container_registry_id != ""
    client_id           = azurerm_user_assigned_identity.train.client_id
    gpus                = local.gpus
    checkpoint_uri      = local.checkpoint_uri
    save_budget_s       = var.save_budget_s
    exit_margin_s       = var.exit_margin_s
    stop_timeout_s      = local.stop_timeout_s
    unit_stop_timeout_s = local.unit_stop_timeout_s
    train_command       = join(" ", [for a in var.train_command : format("'%s'", replace(a, "'", "'\\''"))])
  }))

  lifecycle {
    precondition {
      condition     = local.unit_stop_timeout_s <= 30
      error_message = "save_budget_s + exit_margin_s + 5 must fit the 30 s Scheduled Events Preempt notice."
    }
  }
}

# An AKS spot node pool for deploy/k8s/aks: AKS labels and taints its nodes
# kubernetes.azure.com/scalesetpriority=spot, which the manifests select and tolerate.
resource "azurerm_kubernetes_cluster_node_pool" "spot" {
  count                 = var.aks_cluster_id == "" ? 0 : 1
  name                  = "spot"
  kubernetes_cluster_id = var.aks_cluster_id
  vm_size               = var.vm_size
  priority              = "Spot"
  eviction_policy       = "Delete"
  spot_max_price        = -1
  auto_scaling_enabled  = true
  min_count             = 0
  max_count             = var.aks_max_nodes
  vnet_subnet_id        = var.subnet_id
  max_pods              = 50
  # Temporary and cache disks encrypted on the host, as in the scale set.
  host_encryption_enabled = true
  node_labels             = { "kubernetes.azure.com/scalesetpriority" = "spot" }
  node_taints             = ["kubernetes.azure.com/scalesetpriority=spot:NoSchedule"]
  tags                    = var.tags
}
