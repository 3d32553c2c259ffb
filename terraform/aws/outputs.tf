output "checkpoint_uri" {
  description = "SPOTCKPT_URI for the trainer: the run prefix in the checkpoint bucket."
  value       = "s3://${aws_s3_bucket.checkpoints.bucket}/${var.run_prefix}"
}

output "bucket_name" {
  description = "The checkpoint bucket."
  value       = aws_s3_bucket.checkpoints.bucket
}

output "role_arn" {
  description = "The training role (for IRSA: the eks.amazonaws.com/role-arn annotation in deploy/k8s/eks/base/spotckpt.yaml)."
  value       = aws_iam_role.train.arn
}

output "instance_profile_name" {
  description = "The instance profile of the spot instances."
  value       = aws_iam_instance_profile.train.name
}

output "autoscaling_group_name" {
  description = "Set its desired capacity to 0 once training is done."
  value       = aws_autoscaling_group.train.name
}
