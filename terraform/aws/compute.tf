# Spot capacity: a launch template (IMDSv2 only, encrypted root volume, no public address) and an
# auto-scaling group that keeps one trainer running on whichever spot pool has capacity.

data "aws_ssm_parameter" "ami" {
  name = local.ami_ssm_parameter
}

locals {
  # GPUs go with a CUDA image and GPU instance types (the variables' validations check both).
  gpus = var.accelerator_count > 0
  # Docker on both; the Deep Learning AMI adds the NVIDIA driver and container toolkit.
  ami_ssm_parameter = var.ami_ssm_parameter != "" ? var.ami_ssm_parameter : (
    local.gpus
    ? "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-amazon-linux-2023/latest/ami-id"
    : "/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-x86_64"
  )
  shutdown_timeout_s = var.save_budget_s + var.exit_margin_s
  # docker stop waits for the launcher's (spotckpt launch) shutdown timeout plus its exit.
  stop_timeout_s      = local.shutdown_timeout_s + 10
  unit_stop_timeout_s = local.stop_timeout_s + 10
  checkpoint_uri      = "s3://${aws_s3_bucket.checkpoints.bucket}/${var.run_prefix}"
  ecr_registry        = var.ecr_repository_arn == "" ? "" : split("/", var.container_image)[0]
}

resource "aws_security_group" "train" {
  name        = var.name
  description = "spotckpt trainer: no inbound; HTTPS out to S3, the registry and AWS APIs"
  vpc_id      = var.vpc_id

  egress {
    description = "HTTPS to S3 (or its gateway endpoint), the image registry and STS"
    from_port   = 443
    to_port     = 443
    protocol    = "tcp"
    cidr_blocks = ["0.0.0.0/0"]
  }
}

resource "aws_launch_template" "train" {
  name_prefix   = "${var.name}-"
  description   = "spotckpt trainer on spot instances"
  image_id      = data.aws_ssm_parameter.ami.value
  instance_type = var.instance_types[0]
  ebs_optimized = true

  iam_instance_profile {
    arn = aws_iam_instance_profile.train.arn
  }

  # IMDSv2 only (session tokens); hop limit 1 because the container uses the host network.
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "disabled"
  }

  network_interfaces {
    associate_public_ip_address = false
    security_groups             = [aws_security_group.train.id]
    delete_on_termination       = true
  }

  block_device_mappings {
    device_name = "/dev/xvda"
    ebs {
      volume_size           = var.root_volume_gb
      volume_type           = "gp3"
      encrypted             = true
      delete_on_termination = true
    }
  }

  monitoring {
    enabled = true
  }

  user_data = base64encode(templatefile("${path.module}/user_data.sh.tftpl", {
    image               = var.container_image
    ecr_registry        = local.ecr_registry
    region              = var.region
    gpus                = local.gpus
    checkpoint_uri      = local.checkpoint_uri
    save_budget_s       = var.save_budget_s
    exit_margin_s       = var.exit_margin_s
    stop_timeout_s      = local.stop_timeout_s
    unit_stop_timeout_s = local.unit_stop_timeout_s
    train_command       = join(" ", [for a in var.train_command : format("'%s'", replace(a, "'", "'\\''"))])
  }))

  tag_specifications {
    resource_type = "instance"
    tags          = merge(var.tags, { Name = var.name })
  }
  tag_specifications {
    resource_type = "volume"
    tags          = merge(var.tags, { Name = var.name })
  }
}

resource "aws_autoscaling_group" "train" {
  name                = var.name
  min_size            = 0
  max_size            = max(var.desired_capacity, 1)
  desired_capacity    = var.desired_capacity
  vpc_zone_identifier = var.subnet_ids
  # On a rebalance recommendation (elevated reclaim risk) launch the replacement first; the old
  # instance is then terminated and its trainer saves on SIGTERM. Two trainers may overlap for a
  # moment: spotckpt's create-only manifest makes only one commit per step win.
  capacity_rebalance        = true
  health_check_type         = "EC2"
  health_check_grace_period = 300

  mixed_instances_policy {
    instances_distribution {
      on_demand_base_capacity                  = 0
      on_demand_percentage_above_base_capacity = 0
      # Choose the spot pools least likely to be reclaimed, not the cheapest.
      spot_allocation_strategy = "capacity-optimized"
    }
    launch_template {
      launch_template_specification {
        launch_template_id = aws_launch_template.train.id
        version            = aws_launch_template.train.latest_version
      }
      dynamic "override" {
        for_each = var.instance_types
        content {
          instance_type = override.value
        }
      }
    }
  }

  instance_refresh {
    strategy = "Rolling"
    preferences {
      min_healthy_percentage = 0
    }
  }

  dynamic "tag" {
    for_each = merge(var.tags, { Name = var.name })
    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = true
    }
  }
}
