# What the ecs backend needs in AWS (backends/README.md, backends/src/ecs):
#   - an ECS cluster whose capacity is Fargate (CPU workers, FARGATE and FARGATE_SPOT) and an Auto Scaling
#     group of GPU instances behind a capacity provider (GPU workers: Fargate has no GPUs), which scales
#     from zero when RunTask names the provider and back to zero when the workers are gone;
#   - a VPC with private subnets in two zones and one security group: every task is awsvpc, gets an ENI
#     with a private IP and no public IP, and only the QUIC ports (UDP mesh and coordinator) are open, and
#     only from the same security group;
#   - the workers' execution role (the ECS agent pulls the image, writes logs, and hands each rank's Secrets
#     Manager secret to the `secrets` init container as PHYSALIA_SECRET_BUNDLE) and their task role (no AWS
#     calls today);
#   - the coordinator's permissions, exactly what the backend calls and nothing else: create, tag and delete
#     the per-rank secrets `physalia/<base>/rank-<r>`; register, deregister and delete the per-rank task
#     definitions `<base>_rank<r>` (<base> = `physalia-<job>-s<segment>`, backends/src/names.rs); run,
#     describe, list and stop tasks in this cluster; list task definition families, task definitions and
#     secrets by name prefix (the sweep of `stop_all`); pass exactly the two worker roles to ECS; read the
#     workers' log streams. As a task role for a coordinator that runs as a Fargate task in the same
#     subnets and security group (workers reach its ENI's private IP), and as a policy document for a
#     coordinator that runs elsewhere in the VPC (an EC2 instance);
#   - a CloudWatch log group for the workers (awslogs driver, stream prefix `physalia`).

data "aws_partition" "current" {}
data "aws_region" "current" {}
data "aws_caller_identity" "current" {}

data "aws_availability_zones" "available" {
  state = "available"
  # Regular zones only: local and wavelength zones have neither NAT gateways nor most GPU types.
  filter {
    name   = "opt-in-status"
    values = ["opt-in-not-required"]
  }
}

locals {
  partition = data.aws_partition.current.partition
  region    = data.aws_region.current.region
  account   = data.aws_caller_identity.current.account_id
  azs       = var.availability_zones != null ? var.availability_zones : slice(data.aws_availability_zones.available.names, 0, 2)

  # The backend's names (backends/src/ecs/task.rs): per-rank secrets physalia/<base>/rank-<r> (Secrets
  # Manager appends a random 6-character suffix to the ARN, which the trailing * covers) and task
  # definition families <base>_rank<r>, where <base> is physalia-<job>-s<segment> (`:<revision>` is part
  # of the ARN, also covered). Only the physalia prefix is pinned, so a renamed family or secret under it
  # keeps working.
  secret_arns          = "arn:${local.partition}:secretsmanager:${local.region}:${local.account}:secret:physalia/*"
  task_definition_arns = "arn:${local.partition}:ecs:${local.region}:${local.account}:task-definition/physalia-*"
  task_arns            = "arn:${local.partition}:ecs:${local.region}:${local.account}:task/${aws_ecs_cluster.physalia.name}/*"
}

# ---------------------------------------------------------------------------------------------------------
# Network
# ---------------------------------------------------------------------------------------------------------

resource "aws_vpc" "physalia" {
  cidr_block = var.vpc_cidr
  # Private DNS names of interface endpoints (the alternative to the NAT gateway) need both.
  enable_dns_support   = true
  enable_dns_hostnames = true

  tags = {
    Name = var.cluster_name
  }
}

# Workers, GPU instances and the coordinator all live here; nothing gets a public IP.
resource "aws_subnet" "private" {
  count                   = length(local.azs)
  vpc_id                  = aws_vpc.physalia.id
  cidr_block              = cidrsubnet(var.vpc_cidr, 4, count.index)
  availability_zone       = local.azs[count.index]
  map_public_ip_on_launch = false

  tags = {
    Name = "${var.cluster_name}-private-${local.azs[count.index]}"
  }
}

resource "aws_route_table" "private" {
  vpc_id = aws_vpc.physalia.id

  tags = {
    Name = "${var.cluster_name}-private"
  }
}

resource "aws_route_table_association" "private" {
  count          = length(aws_subnet.private)
  subnet_id      = aws_subnet.private[count.index].id
  route_table_id = aws_route_table.private.id
}

# Outbound access for the private subnets: ECR (image manifests), Secrets Manager (the agent fetches each
# rank's secret), CloudWatch Logs, and the ECS endpoints the GPU instances' agent registers with. One NAT
# gateway in the first zone, not one per zone: cheaper, and losing that zone's egress only delays launches.
# Without it (nat_gateway = false), create interface VPC endpoints for ecr.api, ecr.dkr, secretsmanager,
# logs, ecs, ecs-agent and ecs-telemetry in the private subnets instead (each endpoint bills hourly per zone).
resource "aws_internet_gateway" "physalia" {
  count  = var.nat_gateway ? 1 : 0
  vpc_id = aws_vpc.physalia.id

  tags = {
    Name = var.cluster_name
  }
}

# The NAT gateway's subnet: the last /24 of the VPC (private subnets take the first /20s), no instances.
resource "aws_subnet" "public" {
  count                   = var.nat_gateway ? 1 : 0
  vpc_id                  = aws_vpc.physalia.id
  cidr_block              = cidrsubnet(var.vpc_cidr, 8, 255)
  availability_zone       = local.azs[0]
  map_public_ip_on_launch = false

  tags = {
    Name = "${var.cluster_name}-nat"
  }
}

resource "aws_route_table" "public" {
  count  = var.nat_gateway ? 1 : 0
  vpc_id = aws_vpc.physalia.id

  route {
    cidr_block = "0.0.0.0/0"
    gateway_id = aws_internet_gateway.physalia[0].id
  }

  tags = {
    Name = "${var.cluster_name}-nat"
  }
}

resource "aws_route_table_association" "public" {
  count          = var.nat_gateway ? 1 : 0
  subnet_id      = aws_subnet.public[0].id
  route_table_id = aws_route_table.public[0].id
}

resource "aws_eip" "nat" {
  count  = var.nat_gateway ? 1 : 0
  domain = "vpc"

  tags = {
    Name = "${var.cluster_name}-nat"
  }
}

resource "aws_nat_gateway" "physalia" {
  count         = var.nat_gateway ? 1 : 0
  allocation_id = aws_eip.nat[0].id
  subnet_id     = aws_subnet.public[0].id

  tags = {
    Name = var.cluster_name
  }

  depends_on = [aws_internet_gateway.physalia]
}

resource "aws_route" "private_default" {
  count                  = var.nat_gateway ? 1 : 0
  route_table_id         = aws_route_table.private.id
  destination_cidr_block = "0.0.0.0/0"
  nat_gateway_id         = aws_nat_gateway.physalia[0].id
}

# ECR serves image layers from S3. A gateway endpoint costs nothing and keeps those gigabytes (a CUDA
# worker image is several GB, pulled once per task) off the NAT gateway's per-GB processing charge; it is
# also what makes layer pulls work at all without a NAT gateway.
data "aws_vpc_endpoint_service" "s3" {
  service      = "s3"
  service_type = "Gateway"
}

resource "aws_vpc_endpoint" "s3" {
  vpc_id            = aws_vpc.physalia.id
  service_name      = data.aws_vpc_endpoint_service.s3.service_name
  vpc_endpoint_type = "Gateway"
  route_table_ids   = [aws_route_table.private.id]

  tags = {
    Name = "${var.cluster_name}-s3"
  }
}

# The one security group of every worker task, the coordinator task and the GPU instances' own ENIs.
# Inbound: only UDP on the mesh port and the coordinator port, only from members of this group (workers
# dial the coordinator and each other). Mutual TLS with the job's CA still decides who may talk (DESIGN
# invariant 5). Outbound: everything (registries, AWS endpoints, peers).
resource "aws_security_group" "workers" {
  name        = "physalia-workers"
  description = "Physalia workers and coordinator: QUIC (UDP) between members only"
  vpc_id      = aws_vpc.physalia.id

  tags = {
    Name = "physalia-workers"
  }
}

resource "aws_vpc_security_group_ingress_rule" "mesh" {
  security_group_id            = aws_security_group.workers.id
  referenced_security_group_id = aws_security_group.workers.id
  description                  = "QUIC mesh between workers (PHYSALIA_MESH_PORT)"
  ip_protocol                  = "udp"
  from_port                    = var.mesh_port
  to_port                      = var.mesh_port
}

resource "aws_vpc_security_group_ingress_rule" "coordinator" {
  security_group_id            = aws_security_group.workers.id
  referenced_security_group_id = aws_security_group.workers.id
  description                  = "QUIC control: workers to the coordinator (its port and the 7 after it: a prewarmed launch's endpoint binds the next free one)"
  ip_protocol                  = "udp"
  from_port                    = var.coordinator_port
  to_port                      = var.coordinator_port + 7
}

# Terraform removes the allow-all egress rule AWS puts on a new group, so it is declared here.
resource "aws_vpc_security_group_egress_rule" "all" {
  security_group_id = aws_security_group.workers.id
  description       = "Registries, AWS endpoints and peers"
  ip_protocol       = "-1"
  cidr_ipv4         = "0.0.0.0/0"
}

# ---------------------------------------------------------------------------------------------------------
# Cluster, capacity and logs
# ---------------------------------------------------------------------------------------------------------

resource "aws_ecs_cluster" "physalia" {
  name = var.cluster_name
}

# awslogs driver, stream prefix `physalia`: streams are physalia/<container>/<task id>, which the
# coordinator reads with GetLogEvents (and nothing else).
resource "aws_cloudwatch_log_group" "workers" {
  name              = "/physalia/workers"
  retention_in_days = var.log_retention_days
}

# FARGATE and FARGATE_SPOT are AWS's own providers and only need attaching. Fargate is the default for a
# RunTask that states neither a launch type nor a provider; the backend always states one.
resource "aws_ecs_cluster_capacity_providers" "physalia" {
  cluster_name       = aws_ecs_cluster.physalia.name
  capacity_providers = ["FARGATE", "FARGATE_SPOT", aws_ecs_capacity_provider.gpu.name]

  default_capacity_provider_strategy {
    capacity_provider = "FARGATE"
    weight            = 1
  }
}

# The ECS GPU-optimized AMI (NVIDIA driver, container toolkit, ECS agent), read at plan time: a new
# `terraform apply` picks up a newer AMI for instances launched afterwards. The public parameter is not
# secret, so its plain value is used (the default `value` attribute is always marked sensitive).
data "aws_ssm_parameter" "gpu_ami" {
  name = "/aws/service/ecs/optimized-ami/amazon-linux-2023/gpu/recommended/image_id"
}

resource "aws_launch_template" "gpu" {
  name_prefix            = "${var.cluster_name}-gpu-"
  image_id               = data.aws_ssm_parameter.gpu_ami.insecure_value
  instance_type          = var.gpu_instance_type
  vpc_security_group_ids = [aws_security_group.workers.id]

  iam_instance_profile {
    arn = aws_iam_instance_profile.gpu.arn
  }

  # IMDSv2 only, and one hop: the ECS agent runs with host networking and reaches the metadata service
  # directly; nothing in a container needs the instance role's credentials.
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  # Join the cluster. GPU support is already on in the GPU AMI; it is stated so the intent is visible.
  # ECS_AWSVPC_BLOCK_IMDS keeps awsvpc tasks (the workers) away from the instance metadata service, so a
  # worker cannot borrow the instance role.
  user_data = base64encode(<<-EOT
    #!/bin/bash
    cat >> /etc/ecs/ecs.config <<'CONFIG'
    ECS_CLUSTER=${aws_ecs_cluster.physalia.name}
    ECS_ENABLE_GPU_SUPPORT=true
    ECS_AWSVPC_BLOCK_IMDS=true
    CONFIG
  EOT
  )

  tag_specifications {
    resource_type = "instance"
    tags = {
      Name                 = "${var.cluster_name}-gpu"
      "physalia.dev/infra" = "ecs"
    }
  }
}

# Starts empty; only the capacity provider changes the desired count (ECS managed scaling), so Terraform
# ignores it after creation.
resource "aws_autoscaling_group" "gpu" {
  name                = "${var.cluster_name}-gpu"
  min_size            = 0
  max_size            = var.gpu_max_instances
  desired_capacity    = 0
  vpc_zone_identifier = aws_subnet.private[*].id

  # Managed termination protection is off (see the capacity provider), so nothing would ever lift an
  # instance's scale-in protection: with it on, the group could never shrink.
  protect_from_scale_in = false

  launch_template {
    id      = aws_launch_template.gpu.id
    version = "$Latest"
  }

  # ECS adds this tag when the capacity provider is created; declaring it keeps Terraform from removing
  # it and propagates it to the instances, which managed scaling relies on.
  tag {
    key                 = "AmazonECSManaged"
    value               = "true"
    propagate_at_launch = true
  }

  lifecycle {
    ignore_changes = [desired_capacity]
  }
}

# RunTask with capacityProviderStrategy = [this provider] leaves GPU tasks PROVISIONING; managed scaling
# sees the reservation above 100% and raises the group's desired count (from zero), and lowers it again
# once instances stand empty. Target capacity 100: no idle spare instance is kept (a spare g5 costs about
# $1/h; a cold start costs a few minutes, infra/catalog/aws-ecs.yaml).
#
# Managed termination protection is off. On, it would require scale-in protection on every instance,
# which ECS lifts only from instances without tasks: it would also make `terraform destroy` and manual
# scale-downs wait on protected instances. What it would guard against, scale-in picking an instance that
# still runs a worker, is mostly covered by managed draining below: an instance chosen for scale-in is set
# to DRAINING before it terminates, and draining leaves standalone RunTask tasks running (ECS draining
# docs; how long the termination then waits was not observed here). In the worst case physalia treats a
# killed worker like any lost worker: the coordinator relaunches from the last checkpoint.
resource "aws_ecs_capacity_provider" "gpu" {
  name = "${var.cluster_name}-gpu"

  auto_scaling_group_provider {
    auto_scaling_group_arn         = aws_autoscaling_group.gpu.arn
    managed_termination_protection = "DISABLED"
    managed_draining               = "ENABLED"

    managed_scaling {
      status                    = "ENABLED"
      target_capacity           = 100
      minimum_scaling_step_size = 1
      maximum_scaling_step_size = var.gpu_max_instances
      # Seconds a new instance is given before its metrics count: boot, driver load, agent registration.
      instance_warmup_period = 300
    }
  }
}

# ---------------------------------------------------------------------------------------------------------
# Roles
# ---------------------------------------------------------------------------------------------------------

# Who may assume the task roles: ECS tasks of this account only (confused-deputy guard).
data "aws_iam_policy_document" "ecs_tasks_assume" {
  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["ecs-tasks.amazonaws.com"]
    }

    condition {
      test     = "StringEquals"
      variable = "aws:SourceAccount"
      values   = [local.account]
    }
  }
}

# The workers' execution role: used by the ECS agent, never visible inside a container. The managed policy
# gives ECR pulls and log writes; the inline one gives the per-rank secrets, which ECS injects into the
# `secrets` init container as PHYSALIA_SECRET_BUNDLE (the worker container itself gets no secret variable).
# IAM cannot tell one rank's task from another here, so this role can read every physalia/* secret; only
# the task definition decides which one a task receives. The secrets use the account's default
# aws/secretsmanager key, which needs no kms:Decrypt grant.
resource "aws_iam_role" "execution" {
  name               = "${var.cluster_name}-task-execution"
  assume_role_policy = data.aws_iam_policy_document.ecs_tasks_assume.json
}

resource "aws_iam_role_policy_attachment" "execution" {
  role       = aws_iam_role.execution.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/service-role/AmazonECSTaskExecutionRolePolicy"
}

data "aws_iam_policy_document" "execution_secrets" {
  statement {
    sid       = "RankSecrets"
    actions   = ["secretsmanager:GetSecretValue"]
    resources = [local.secret_arns]
  }
}

resource "aws_iam_role_policy" "execution_secrets" {
  name   = "physalia-rank-secrets"
  role   = aws_iam_role.execution.id
  policy = data.aws_iam_policy_document.execution_secrets.json
}

# The workers' task role: what code inside a worker may call. Nothing today (workers talk QUIC to the
# coordinator and each other, and read their assignment from it). Reading datasets from S3 would add
# s3:GetObject on the dataset bucket: set dataset_bucket_arn and it is granted, read-only.
resource "aws_iam_role" "worker" {
  name               = "${var.cluster_name}-worker"
  assume_role_policy = data.aws_iam_policy_document.ecs_tasks_assume.json
}

data "aws_iam_policy_document" "worker_datasets" {
  count = var.dataset_bucket_arn == null ? 0 : 1

  statement {
    sid       = "ListDatasets"
    actions   = ["s3:ListBucket"]
    resources = [var.dataset_bucket_arn]
  }

  # A bucket encrypted with a customer-managed KMS key would also need kms:Decrypt on that key.
  statement {
    sid       = "ReadDatasets"
    actions   = ["s3:GetObject"]
    resources = ["${var.dataset_bucket_arn}/*"]
  }
}

resource "aws_iam_role_policy" "worker_datasets" {
  count  = var.dataset_bucket_arn == null ? 0 : 1
  name   = "physalia-datasets"
  role   = aws_iam_role.worker.id
  policy = data.aws_iam_policy_document.worker_datasets[0].json
}

# The GPU instances' role: the ECS agent registers the instance, polls for tasks and reports their state
# (AmazonEC2ContainerServiceforEC2Role). No SSM Session Manager or other extras: add
# AmazonSSMManagedInstanceCore yourself to get a shell on an instance.
data "aws_iam_policy_document" "ec2_assume" {
  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "gpu_instance" {
  name               = "${var.cluster_name}-gpu-instance"
  assume_role_policy = data.aws_iam_policy_document.ec2_assume.json
}

resource "aws_iam_role_policy_attachment" "gpu_instance" {
  role       = aws_iam_role.gpu_instance.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/service-role/AmazonEC2ContainerServiceforEC2Role"
}

resource "aws_iam_instance_profile" "gpu" {
  name = "${var.cluster_name}-gpu-instance"
  role = aws_iam_role.gpu_instance.name
}

# ---------------------------------------------------------------------------------------------------------
# The coordinator
# ---------------------------------------------------------------------------------------------------------

# Exactly what the ecs backend calls. Resource-level scoping follows the IAM service authorization
# reference for ECS, Secrets Manager and CloudWatch Logs:
#   - DeregisterTaskDefinition and the three List calls (ListTaskDefinitionFamilies, ListTaskDefinitions,
#     ListSecrets) support no resource-level permissions, so they are on "*". The lists return names and
#     metadata (ListSecrets never returns a value); stop_all uses them to find every family and secret
#     under a launch's prefix, including ones a crashed coordinator left behind;
#   - ListTasks is scoped by the ecs:cluster condition, RunTask by the task definition family and that
#     condition, DescribeTasks and StopTask by the task ARN (task/<cluster>/<id>);
#   - ecs:TagResource and secretsmanager:TagResource are only for tags given at creation (ECS checks
#     TagResource on RegisterTaskDefinition and RunTask requests that carry tags; ecs:CreateAction pins
#     that down; Secrets Manager checks it on CreateSecret with tags, limited here to physalia/* secrets);
#   - iam:PassRole covers only the two worker roles, and only towards ECS tasks. This is what stops a
#     task definition in the physalia-* namespace (the coordinator's own included) from being registered
#     or run with any other role.
data "aws_iam_policy_document" "coordinator" {
  statement {
    sid       = "RankSecrets"
    actions   = ["secretsmanager:CreateSecret", "secretsmanager:TagResource", "secretsmanager:DeleteSecret"]
    resources = [local.secret_arns]
  }

  statement {
    sid       = "WorkerTaskDefinitions"
    actions   = ["ecs:RegisterTaskDefinition", "ecs:DeleteTaskDefinitions"]
    resources = [local.task_definition_arns]
  }

  statement {
    sid       = "DeregisterTaskDefinitions"
    actions   = ["ecs:DeregisterTaskDefinition"]
    resources = ["*"]
  }

  statement {
    sid = "FindLeftovers"
    actions = [
      "ecs:ListTaskDefinitionFamilies",
      "ecs:ListTaskDefinitions",
      "secretsmanager:ListSecrets",
    ]
    resources = ["*"]
  }

  statement {
    sid       = "RunWorkers"
    actions   = ["ecs:RunTask"]
    resources = [local.task_definition_arns]

    condition {
      test     = "ArnEquals"
      variable = "ecs:cluster"
      values   = [aws_ecs_cluster.physalia.arn]
    }
  }

  # The preflight (Backend::check) and the coordinator's launch ask whether the cluster exists first.
  statement {
    sid       = "FindCluster"
    actions   = ["ecs:DescribeClusters"]
    resources = [aws_ecs_cluster.physalia.arn]
  }

  # The preflight reads the account's vCPU quota the workers count against (EC2's instance family
  # quota, or Fargate's); Service Quotas takes no resource-level permissions for these reads.
  statement {
    sid       = "ReadQuotas"
    actions   = ["servicequotas:GetServiceQuota", "servicequotas:GetAWSDefaultServiceQuota"]
    resources = ["*"]
  }

  statement {
    sid       = "WatchAndStopWorkers"
    actions   = ["ecs:DescribeTasks", "ecs:StopTask"]
    resources = [local.task_arns]
  }

  statement {
    sid       = "ListWorkers"
    actions   = ["ecs:ListTasks"]
    resources = ["*"]

    condition {
      test     = "ArnEquals"
      variable = "ecs:cluster"
      values   = [aws_ecs_cluster.physalia.arn]
    }
  }

  statement {
    sid       = "TagAtCreation"
    actions   = ["ecs:TagResource"]
    resources = [local.task_definition_arns, local.task_arns]

    condition {
      test     = "StringEquals"
      variable = "ecs:CreateAction"
      values   = ["RegisterTaskDefinition", "RunTask"]
    }
  }

  statement {
    sid       = "PassWorkerRoles"
    actions   = ["iam:PassRole"]
    resources = [aws_iam_role.execution.arn, aws_iam_role.worker.arn]

    condition {
      test     = "StringEquals"
      variable = "iam:PassedToService"
      values   = ["ecs-tasks.amazonaws.com"]
    }
  }

  statement {
    sid       = "ReadWorkerLogs"
    actions   = ["logs:GetLogEvents"]
    resources = ["${aws_cloudwatch_log_group.workers.arn}:log-stream:physalia/*"]
  }
}

# What `physalia submit` needs of the submitting user in cluster mode (output submitter_policy_json, to
# attach to the user's group or SSO permission set): the preflight's reads (the cluster, the account's
# vCPU quota, what already counts against it: the cluster's tasks, or its container instances), the
# coordinator's task (register, run,
# watch, read its log, stop, delete), passing the coordinator's two roles to ECS, and the job store.
# backends/tests/ecs holds it to exactly the calls a submission makes.
data "aws_iam_policy_document" "submitter" {
  # the job store as the coordinator has it (uploads, records, partitions)
  source_policy_documents = [data.aws_iam_policy_document.coordinator_store.json]

  statement {
    sid       = "FindCluster"
    actions   = ["ecs:DescribeClusters"]
    resources = [aws_ecs_cluster.physalia.arn]
  }

  statement {
    sid       = "ReadQuotas"
    actions   = ["servicequotas:GetServiceQuota", "servicequotas:GetAWSDefaultServiceQuota"]
    resources = ["*"]
  }

  statement {
    sid     = "FindContainerInstances"
    actions = ["ecs:ListContainerInstances", "ecs:DescribeContainerInstances"]
    resources = [
      aws_ecs_cluster.physalia.arn,
      "arn:${local.partition}:ecs:${local.region}:${local.account}:container-instance/${aws_ecs_cluster.physalia.name}/*",
    ]
  }

  # the preflight counts the cluster's running Fargate tasks against the Fargate vCPU quota (it
  # describes them under WatchAndStopCoordinator's task ARNs)
  statement {
    sid       = "ListTasks"
    actions   = ["ecs:ListTasks"]
    resources = ["*"]

    condition {
      test     = "ArnEquals"
      variable = "ecs:cluster"
      values   = [aws_ecs_cluster.physalia.arn]
    }
  }

  statement {
    sid       = "CoordinatorTaskDefinition"
    actions   = ["ecs:RegisterTaskDefinition", "ecs:DeleteTaskDefinitions"]
    resources = [local.task_definition_arns]
  }

  statement {
    sid       = "DeregisterTaskDefinition"
    actions   = ["ecs:DeregisterTaskDefinition"]
    resources = ["*"]
  }

  statement {
    sid       = "RunCoordinator"
    actions   = ["ecs:RunTask"]
    resources = [local.task_definition_arns]

    condition {
      test     = "ArnEquals"
      variable = "ecs:cluster"
      values   = [aws_ecs_cluster.physalia.arn]
    }
  }

  statement {
    sid       = "WatchAndStopCoordinator"
    actions   = ["ecs:DescribeTasks", "ecs:StopTask"]
    resources = [local.task_arns]
  }

  statement {
    sid       = "TagAtCreation"
    actions   = ["ecs:TagResource"]
    resources = [local.task_definition_arns, local.task_arns]

    condition {
      test     = "StringEquals"
      variable = "ecs:CreateAction"
      values   = ["RegisterTaskDefinition", "RunTask"]
    }
  }

  statement {
    sid       = "PassCoordinatorRoles"
    actions   = ["iam:PassRole"]
    resources = [aws_iam_role.execution.arn, aws_iam_role.coordinator.arn]

    condition {
      test     = "StringEquals"
      variable = "iam:PassedToService"
      values   = ["ecs-tasks.amazonaws.com"]
    }
  }

  statement {
    sid       = "ReadCoordinatorLog"
    actions   = ["logs:GetLogEvents"]
    resources = ["${aws_cloudwatch_log_group.workers.arn}:log-stream:physalia/*"]
  }

}

# The job store (`output.dir: s3://<bucket>/jobs`, `terraform output job_store`): job records, uploaded
# datasets and the partitions the coordinator computes beside them. Private and encrypted; the coordinator
# role reads and writes it, workers never touch it (they get everything through the coordinator).
resource "aws_s3_bucket" "jobs" {
  bucket_prefix = "${var.cluster_name}-jobs-"
}

resource "aws_s3_bucket_public_access_block" "jobs" {
  bucket                  = aws_s3_bucket.jobs.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_server_side_encryption_configuration" "jobs" {
  bucket = aws_s3_bucket.jobs.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm = "AES256"
    }
  }
}

# A dataset goes up in parts above 32 MiB; an upload cut short leaves parts that are billed until aborted.
resource "aws_s3_bucket_lifecycle_configuration" "jobs" {
  bucket = aws_s3_bucket.jobs.id

  rule {
    id     = "abort-incomplete-uploads"
    status = "Enabled"
    filter {}

    abort_incomplete_multipart_upload {
      days_after_initiation = 1
    }
  }
}

# What the coordinator does with the store (orchestrator/src/store.rs through object_store): list a job's
# record, read, write (in one request or in parts) and delete objects, abort an upload it cut short; read
# datasets in dataset_bucket_arn when that is set.
data "aws_iam_policy_document" "coordinator_store" {
  statement {
    sid       = "ListJobStore"
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.jobs.arn]
  }

  statement {
    sid       = "ReadWriteJobStore"
    actions   = ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"]
    resources = ["${aws_s3_bucket.jobs.arn}/*"]
  }

  dynamic "statement" {
    for_each = var.dataset_bucket_arn == null ? [] : [var.dataset_bucket_arn]

    content {
      sid       = "ReadDatasets"
      actions   = ["s3:ListBucket", "s3:GetObject"]
      resources = [statement.value, "${statement.value}/*"]
    }
  }
}

resource "aws_iam_role_policy" "coordinator_store" {
  name   = "physalia-job-store"
  role   = aws_iam_role.coordinator.id
  policy = data.aws_iam_policy_document.coordinator_store.json
}

# The coordinator as an ECS task: the AWS SDK's default chain finds these credentials through the container
# credentials endpoint. A coordinator on an EC2 instance in the VPC attaches coordinator_policy_json to its
# instance role instead.
resource "aws_iam_role" "coordinator" {
  name               = "${var.cluster_name}-coordinator"
  assume_role_policy = data.aws_iam_policy_document.ecs_tasks_assume.json
}

resource "aws_iam_role_policy" "coordinator" {
  name   = "physalia-ecs-launcher"
  role   = aws_iam_role.coordinator.id
  policy = data.aws_iam_policy_document.coordinator.json
}

resource "aws_cloudwatch_log_group" "coordinator" {
  count             = var.coordinator_image == null ? 0 : 1
  name              = "/physalia/coordinator"
  retention_in_days = var.log_retention_days
}

# Optional (coordinator_image): a coordinator task definition to run by hand. `physalia submit` does not
# need it: cluster mode registers its own `physalia-<job>-coordinator` task definition per job with the
# coordinator role below (backends/src/ecs), runs `physalia coordinate <job URL> --control-port 7000` and
# deletes it at the end. Fargate, awsvpc, in the private subnets with the workers' security group, so
# workers reach the task's ENI private IP on coordinator_port; it shares the workers' execution role.
resource "aws_ecs_task_definition" "coordinator" {
  count                    = var.coordinator_image == null ? 0 : 1
  family                   = "physalia-coordinator"
  requires_compatibilities = ["FARGATE"]
  network_mode             = "awsvpc"
  cpu                      = 1024
  memory                   = 2048
  execution_role_arn       = aws_iam_role.execution.arn
  task_role_arn            = aws_iam_role.coordinator.arn

  runtime_platform {
    operating_system_family = "LINUX"
    cpu_architecture        = "X86_64"
  }

  container_definitions = jsonencode([
    {
      name      = "coordinator"
      image     = var.coordinator_image
      essential = true
      portMappings = [
        {
          containerPort = var.coordinator_port
          protocol      = "udp"
        }
      ]
      environment = [
        { name = "AWS_REGION", value = local.region },
        { name = "PHYSALIA_COORDINATOR_BIND", value = "0.0.0.0:${var.coordinator_port}" },
      ]
      logConfiguration = {
        logDriver = "awslogs"
        options = {
          "awslogs-group"         = aws_cloudwatch_log_group.coordinator[0].name
          "awslogs-region"        = local.region
          "awslogs-stream-prefix" = "coordinator"
        }
      }
    }
  ])
}
