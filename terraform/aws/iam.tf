# The training identity: an EC2 role (and, optionally, an IRSA trust for EKS) that may read,
# write, list and delete objects under the run prefix, and nothing else.

locals {
  bucket_arn  = aws_s3_bucket.checkpoints.arn
  objects_arn = "${aws_s3_bucket.checkpoints.arn}/${var.run_prefix}/*"
}

data "aws_iam_policy_document" "assume" {
  statement {
    sid     = "EC2"
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }

  # IRSA: the EKS service account of deploy/k8s/eks/base/spotckpt.yaml, and only that one.
  dynamic "statement" {
    for_each = var.eks_oidc_provider_arn == "" ? [] : [var.eks_oidc_provider_arn]
    content {
      sid     = "EKSServiceAccount"
      actions = ["sts:AssumeRoleWithWebIdentity"]
      principals {
        type        = "Federated"
        identifiers = [statement.value]
      }
      condition {
        test     = "StringEquals"
        variable = "${replace(statement.value, "/^.*oidc-provider//", "")}:sub"
        values   = ["system:serviceaccount:${replace(var.eks_service_account, "/", ":")}"]
      }
      condition {
        test     = "StringEquals"
        variable = "${replace(statement.value, "/^.*oidc-provider//", "")}:aud"
        values   = ["sts.amazonaws.com"]
      }
    }
  }
}

resource "aws_iam_role" "train" {
  name               = var.name
  description        = "spotckpt training: checkpoints under s3://${var.bucket_name}/${var.run_prefix}/ only"
  assume_role_policy = data.aws_iam_policy_document.assume.json
}

data "aws_iam_policy_document" "checkpoints" {
  # Objects: get (also HEAD and ranged reads), put (also multipart create, part, complete),
  # delete (retention and gc), and the multipart clean-up calls, under the run prefix only.
  statement {
    sid = "RunPrefixObjects"
    actions = [
      "s3:GetObject",
      "s3:PutObject",
      "s3:DeleteObject",
      "s3:AbortMultipartUpload",
      "s3:ListMultipartUploadParts",
    ]
    resources = [local.objects_arn]
  }

  # Listing the bucket, limited by a prefix condition to the run prefix.
  statement {
    sid       = "ListRunPrefix"
    actions   = ["s3:ListBucket"]
    resources = [local.bucket_arn]
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = [var.run_prefix, "${var.run_prefix}/*"]
    }
  }

  # Finding unfinished uploads to abort (`spotckpt gc`). S3 has no prefix condition key for
  # this action: it lists upload keys bucket-wide, but reads no object data.
  statement {
    sid       = "ListMultipartUploads"
    actions   = ["s3:ListBucketMultipartUploads"]
    resources = [local.bucket_arn]
  }

  # SSE-KMS: data keys for writes, decryption for reads and multipart completion.
  statement {
    sid       = "BucketKey"
    actions   = ["kms:GenerateDataKey", "kms:Decrypt"]
    resources = [aws_kms_key.checkpoints.arn]
  }

  # Pulling the training image from a private ECR repository, when there is one.
  dynamic "statement" {
    for_each = var.ecr_repository_arn == "" ? [] : [var.ecr_repository_arn]
    content {
      sid       = "PullImage"
      actions   = ["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability"]
      resources = [statement.value]
    }
  }
  dynamic "statement" {
    for_each = var.ecr_repository_arn == "" ? [] : [var.ecr_repository_arn]
    content {
      sid = "RegistryLogin"
      # GetAuthorizationToken is account-wide by design: it has no resource to restrict.
      actions   = ["ecr:GetAuthorizationToken"]
      resources = ["*"]
    }
  }
}

resource "aws_iam_role_policy" "checkpoints" {
  name   = "${var.name}-checkpoints"
  role   = aws_iam_role.train.id
  policy = data.aws_iam_policy_document.checkpoints.json
}

resource "aws_iam_instance_profile" "train" {
  name = var.name
  role = aws_iam_role.train.name
}
