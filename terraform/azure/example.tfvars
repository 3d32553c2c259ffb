# Example values (CPU VMs, the CPU image): copy to terraform.tfvars and edit. For NVIDIA GPUs start
# from example-cuda.tfvars instead. No credentials belong here; terraform takes them from the
# environment (az login, or ARM_* variables of a CI identity).
name                 = "spotckpt-train"
resource_group_name  = "spotckpt-train"
location             = "eastus"
storage_account_name = "myspotckptcheckpoints"
container_name       = "checkpoints"
run_prefix           = "runs/exp1"
vm_size              = "Standard_D4s_v5"
subnet_id            = "/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/network/providers/Microsoft.Network/virtualNetworks/training/subnets/spot"
# The image: spotckpt:cpu as pushed (the example trainer), or your trainer built FROM it.
container_image = "myregistry.azurecr.io/spotckpt:0.1.0-cpu"
image_variant   = "cpu"
# Grants the identity AcrPull on this registry and logs the VMs in with it.
container_registry_id = "/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/registry/providers/Microsoft.ContainerRegistry/registries/myregistry"
# The training command in place of the image's CMD; [] runs the image's CMD.
train_command        = ["/opt/spotckpt/train.py", "--steps", "100000", "--save-every", "200"]
accelerator_count    = 0
save_budget_s        = 15
admin_ssh_public_key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExampleExampleExampleExampleExampleExample spotckpt"
# Let the service account of deploy/k8s/aks/base/spotckpt.yaml act as the identity; "" to skip.
aks_oidc_issuer_url = "https://eastus.oic.prod-aks.azure.com/00000000-0000-0000-0000-000000000000/11111111-1111-1111-1111-111111111111/"
tags                = { project = "spotckpt", owner = "ml-platform" }
