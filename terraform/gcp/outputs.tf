output "checkpoint_uri" {
  description = "SPOTCKPT_URI for the trainer: the run prefix in the checkpoint bucket."
  value       = "gs://${google_storage_bucket.checkpoints.name}/${var.run_prefix}"
}

output "bucket_name" {
  description = "The checkpoint bucket."
  value       = google_storage_bucket.checkpoints.name
}

output "service_account_email" {
  description = "The training service account (for Workload Identity: the iam.gke.io/gcp-service-account annotation in deploy/k8s/gke/base/spotckpt.yaml)."
  value       = google_service_account.train.email
}

output "instance_group_manager" {
  description = "Resize it to 0 once training is done."
  value       = google_compute_instance_group_manager.train.name
}
