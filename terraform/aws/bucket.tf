# The checkpoint bucket: private, encrypted with a customer-managed key, reachable over TLS only,
# and with a lifecycle that cleans up what an interrupted save can leave behind.

data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

resource "aws_kms_key" "checkpoints" {
  description             = "${var.name}: encryption of the checkpoint bucket"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  # The account administers the key; the training role gets use of it through its IAM policy.
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Sid       = "AccountAdministers"
      Effect    = "Allow"
      Principal = { AWS = "arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root" }
      Action    = "kms:*"
      Resource  = "*"
    }]
  })
}

resource "aws_kms_alias" "checkpoints" {
  name          = "alias/${var.name}-checkpoints"
  target_key_id = aws_kms_key.checkpoints.key_id
}

resource "aws_s3_bucket" "checkpoints" {
  #checkov:skip=CKV_AWS_18:Access logs need a second bucket per deployment; audit object access with CloudTrail data events instead
  #checkov:skip=CKV_AWS_144:Checkpoints are re-creatable training state; replicating every multi-GB shard doubles storage and egress
  #checkov:skip=CKV2_AWS_62:Nothing consumes bucket events; the manifest commit is discovered by listing
  bucket = var.bucket_name
  # Never delete checkpoints with the stack by accident.
  force_destroy = false
}

resource "aws_s3_bucket_public_access_block" "checkpoints" {
  bucket                  = aws_s3_bucket.checkpoints.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

# ACLs off: access is decided by IAM and the bucket policy only.
resource "aws_s3_bucket_ownership_controls" "checkpoints" {
  bucket = aws_s3_bucket.checkpoints.id
  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "checkpoints" {
  bucket = aws_s3_bucket.checkpoints.id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = aws_kms_key.checkpoints.arn
    }
    # One data key per bucket instead of a KMS call per part: uploads stay fast and cheap.
    bucket_key_enabled = true
  }
}

# Versioning keeps a deleted or overwritten object for noncurrent_days: a safety net against a
# wrong `spotckpt gc` or retention setting. The lifecycle below expires those copies.
resource "aws_s3_bucket_versioning" "checkpoints" {
  bucket = aws_s3_bucket.checkpoints.id
  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "checkpoints" {
  bucket     = aws_s3_bucket.checkpoints.id
  depends_on = [aws_s3_bucket_versioning.checkpoints]

  # A save interrupted by the reclaim leaves its multipart upload open; its parts are billed
  # until aborted. spotckpt aborts what it can; this catches what a killed VM could not.
  rule {
    id     = "abort-incomplete-multipart-uploads"
    status = "Enabled"
    filter {}
    abort_incomplete_multipart_upload {
      days_after_initiation = 1
    }
  }

  rule {
    id     = "expire-deleted-checkpoints"
    status = "Enabled"
    filter {}
    noncurrent_version_expiration {
      noncurrent_days = 7
    }
    expiration {
      expired_object_delete_marker = true
    }
  }
}

# TLS only: deny every request that arrives over plain HTTP or an old TLS version.
data "aws_iam_policy_document" "bucket" {
  statement {
    sid       = "DenyInsecureTransport"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [aws_s3_bucket.checkpoints.arn, "${aws_s3_bucket.checkpoints.arn}/*"]
    principals {
      type        = "*"
      identifiers = ["*"]
    }
    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
  statement {
    sid       = "DenyOldTLS"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [aws_s3_bucket.checkpoints.arn, "${aws_s3_bucket.checkpoints.arn}/*"]
    principals {
      type        = "*"
      identifiers = ["*"]
    }
    condition {
      test     = "NumericLessThan"
      variable = "s3:TlsVersion"
      values   = ["1.2"]
    }
  }
}

resource "aws_s3_bucket_policy" "checkpoints" {
  bucket = aws_s3_bucket.checkpoints.id
  policy = data.aws_iam_policy_document.bucket.json
  # The public access block must exist first, or S3 may evaluate the policy without it.
  depends_on = [aws_s3_bucket_public_access_block.checkpoints]
}
