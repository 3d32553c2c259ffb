# The training identity: a service account with object access on the checkpoint bucket only.
# It has no project-level role and no keys: the VMs (and, optionally, a GKE service account
# through Workload Identity) get short-lived tokens from the metadata server.

resource "google_service_account" "train" {
  account_id   = var.name
  display_name = "spotckpt trainer"
  description  = "Reads and writes checkpoints in gs://${var.bucket_name} only"
}

# objectUser: get, create, delete, list objects and manage multipart uploads; no bucket
# settings, no IAM.
resource "google_storage_bucket_iam_member" "train_objects" {
  bucket = google_storage_bucket.checkpoints.name
  role   = "roles/storage.objectUser"
  member = "serviceAccount:${google_service_account.train.email}"
}

# Workload Identity for deploy/k8s/gke/base/spotckpt.yaml: only the named Kubernetes service account.
resource "google_service_account_iam_member" "gke_workload_identity" {
  count              = var.gke_workload_identity == "" ? 0 : 1
  service_account_id = google_service_account.train.name
  role               = "roles/iam.workloadIdentityUser"
  member             = "serviceAccount:${var.project_id}.svc.id.goog[${var.gke_workload_identity}]"
}

# Pulling the training image from a private Artifact Registry repository, when there is one.
resource "google_artifact_registry_repository_iam_member" "train_pull" {
  count      = var.artifact_registry_repository == "" ? 0 : 1
  project    = split("/", var.artifact_registry_repository)[1]
  location   = split("/", var.artifact_registry_repository)[3]
  repository = split("/", var.artifact_registry_repository)[5]
  role       = "roles/artifactregistry.reader"
  member     = "serviceAccount:${google_service_account.train.email}"
}
