# Example values for NVIDIA GPUs: a CUDA image on GPU spot instances. Copy to terraform.tfvars and
# edit. The GPU settings go together (the variables' validations refuse a mix): image_variant
# "cuda" for an image built FROM spotckpt:cuda, GPU instance types, and their GPU count.
# No credentials belong here; terraform takes them from the environment.
name           = "spotckpt-train"
region         = "us-east-1"
bucket_name    = "my-spotckpt-checkpoints"
run_prefix     = "runs/exp1"
instance_types = ["g5.xlarge", "g6.xlarge", "g4dn.xlarge"]
vpc_id         = "vpc-0123456789abcdef0"
subnet_ids     = ["subnet-0123456789abcdef0", "subnet-0fedcba9876543210"]
# The image: spotckpt:cuda as pushed (the example trainer), or your trainer built FROM it.
container_image = "111122223333.dkr.ecr.us-east-1.amazonaws.com/spotckpt:0.1.0-cuda"
image_variant   = "cuda"
# Grants the instance role pull rights on this repository only.
ecr_repository_arn = "arn:aws:ecr:us-east-1:111122223333:repository/spotckpt"
# The training command in place of the image's CMD; [] runs the image's CMD.
train_command = ["/opt/spotckpt/train.py", "--steps", "100000", "--save-every", "500"]
# GPUs per instance: each of the types above has one.
accelerator_count = 1
save_budget_s     = 60
# Let the EKS service account of deploy/k8s/eks/base/spotckpt.yaml assume the same role (IRSA); "" to skip.
eks_oidc_provider_arn = ""
tags                  = { project = "spotckpt", owner = "ml-platform" }
