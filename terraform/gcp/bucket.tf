# The checkpoint bucket: uniform (IAM-only) access, public access prevented, and lifecycle rules
# that clean up what an interrupted save can leave behind.

resource "google_storage_bucket" "checkpoints" {
  #checkov:skip=CKV_GCP_62:Access logs need a second bucket per deployment; audit object access with Data Access audit logs instead
  name     = var.bucket_name
  location = upper(var.region)
  labels   = var.labels
  # Never delete checkpoints with the stack by accident.
  force_destroy = false

  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"

  # Keeps a deleted or overwritten object for 7 days: a safety net against a wrong
  # `spotckpt gc` or retention setting. The second rule expires those copies.
  versioning {
    enabled = true
  }

  # A save interrupted by the preemption leaves its XML-API multipart upload open, billed until
  # aborted. spotckpt aborts what it can; this catches what a stopped VM could not. (Resumable
  # uploads expire on their own after a week.)
  lifecycle_rule {
    condition {
      age = 1
    }
    action {
      type = "AbortIncompleteMultipartUpload"
    }
  }

  lifecycle_rule {
    condition {
      days_since_noncurrent_time = 7
      with_state                 = "ARCHIVED"
    }
    action {
      type = "Delete"
    }
  }
}
