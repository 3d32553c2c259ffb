# Spot capacity: an instance template (Spot provisioning, Shielded VM, no public address, the
# training service account) and a managed instance group that keeps one trainer running: it
# restarts a preempted VM when capacity returns, and the VM's startup script starts the job,
# which resumes from the latest checkpoint.

data "google_compute_image" "cos" {
  family  = "cos-stable"
  project = "cos-cloud"
}

locals {
  shutdown_timeout_s = var.save_budget_s + var.exit_margin_s
  # docker stop waits for the launcher's shutdown timeout plus its exit; all of it has
  # to fit in the 30 s between the preemption notice and the hard stop.
  stop_timeout_s      = local.shutdown_timeout_s + 3
  unit_stop_timeout_s = local.stop_timeout_s + 2
  checkpoint_uri      = "gs://${google_storage_bucket.checkpoints.name}/${var.run_prefix}"
  # GPUs go with a CUDA image and a GPU machine type (the variables' validations check both).
  gpus        = var.accelerator_count > 0
  gpu_devices = join(" ", [for i in range(var.accelerator_count) : "--device /dev/nvidia${i}:/dev/nvidia${i}"])
}

resource "google_compute_instance_template" "train" {
  name_prefix  = "${var.name}-"
  description  = "spotckpt trainer on Spot VMs"
  machine_type = var.machine_type
  labels       = var.labels

  # Spot: no automatic restart by Compute Engine itself; the managed instance group restarts
  # the stopped VM when capacity returns.
  scheduling {
    provisioning_model          = "SPOT"
    preemptible                 = true
    automatic_restart           = false
    on_host_maintenance         = "TERMINATE"
    instance_termination_action = "STOP"
  }

  # Attached GPUs (N1 machine types); g2, a2 and a3 machine types come with theirs.
  dynamic "guest_accelerator" {
    for_each = var.accelerator_type != "" ? [var.accelerator_type] : []
    content {
      type  = guest_accelerator.value
      count = var.accelerator_count
    }
  }

  disk {
    source_image = data.google_compute_image.cos.self_link
    boot         = true
    auto_delete  = true
    disk_size_gb = var.boot_disk_gb
    disk_type    = "pd-balanced"
  }

  # No access_config: no public address. Private Google Access reaches Cloud Storage.
  network_interface {
    subnetwork = var.subnetwork
  }

  service_account {
    email = google_service_account.train.email
    # The service account's IAM bindings (object access on one bucket) are what limit it.
    scopes = ["https://www.googleapis.com/auth/cloud-platform"]
  }

  shielded_instance_config {
    enable_secure_boot          = true
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }

  metadata = {
    block-project-ssh-keys = "true"
    enable-oslogin         = "TRUE"
    serial-port-enable     = "false"
    google-logging-enabled = "true"
    startup-script = templatefile("${path.module}/startup.sh.tftpl", {
      image               = var.container_image
      registry            = split("/", var.container_image)[0]
      gpus                = local.gpus
      gpu_devices         = local.gpu_devices
      checkpoint_uri      = local.checkpoint_uri
      save_budget_s       = var.save_budget_s
      exit_margin_s       = var.exit_margin_s
      stop_timeout_s      = local.stop_timeout_s
      unit_stop_timeout_s = local.unit_stop_timeout_s
      train_command       = join(" ", [for a in var.train_command : format("'%s'", replace(a, "'", "'\\''"))])
    })
  }

  lifecycle {
    create_before_destroy = true
    precondition {
      condition     = local.unit_stop_timeout_s <= 30
      error_message = "save_budget_s + exit_margin_s + 5 must fit the 30 s Spot preemption notice."
    }
  }
}

resource "google_compute_instance_group_manager" "train" {
  name               = var.name
  zone               = var.zone
  base_instance_name = var.name
  target_size        = var.target_size

  version {
    instance_template = google_compute_instance_template.train.self_link_unique
  }

  # A VM that stops (preempted) or fails is brought back: restarted or recreated.
  instance_lifecycle_policy {
    default_action_on_failure = "REPAIR"
  }

  # A new template replaces the VM (one trainer at a time: no surge).
  update_policy {
    type                  = "PROACTIVE"
    minimal_action        = "REPLACE"
    max_surge_fixed       = 0
    max_unavailable_fixed = 1
  }
}
