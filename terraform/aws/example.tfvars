# Example values: copy to terraform.tfvars and edit. No credentials belong here; terraform takes
# them from the environment (AWS SSO, a profile, or a CI role).
name            = "spotckpt-train"
region          = "us-east-1"
bucket_name     = "my-spotckpt-checkpoints"
run_prefix      = "runs/exp1"
instance_types  = ["g5.xlarge", "g6.xlarge", "g4dn.xlarge"]
vpc_id          = "vpc-0123456789abcdef0"
subnet_ids      = ["subnet-0123456789abcdef0", "subnet-0fedcba9876543210"]
container_image = "111122223333.dkr.ecr.us-east-1.amazonaws.com/spotckpt:0.1.0-cuda"
# Grants the instance role pull rights on this repository only.
ecr_repository_arn = "arn:aws:ecr:us-east-1:111122223333:repository/spotckpt"
train_args         = ["--steps", "100000", "--save-every", "500"]
save_budget_s      = 60
# Let the EKS service account of deploy/k8s/eks.yaml assume the same role (IRSA); "" to skip.
eks_oidc_provider_arn = ""
tags                  = { project = "spotckpt", owner = "ml-platform" }
