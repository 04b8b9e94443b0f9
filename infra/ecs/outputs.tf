# The ecs backend's configuration: the job file's `backend: {kind: ecs, ...}` fields, same names.
output "cluster" {
  value = aws_ecs_cluster.physalia.name
}

output "subnets" {
  value = aws_subnet.private[*].id
}

output "mesh_port" {
  description = "The job file's backend.ecs.mesh_port: the UDP port the security group opens between the tasks."
  value       = var.mesh_port
}

output "security_groups" {
  value = [aws_security_group.workers.id]
}

output "execution_role_arn" {
  value = aws_iam_role.execution.arn
}

output "task_role_arn" {
  value = aws_iam_role.worker.arn
}

output "log_group" {
  value = aws_cloudwatch_log_group.workers.name
}

output "gpu_capacity_provider" {
  description = "`capacity` for GPU workers: RunTask with this provider scales the GPU group from zero (plain `ec2` does not)."
  value       = aws_ecs_capacity_provider.gpu.name
}

output "fargate_capacity_provider" {
  description = "Fargate's capacity provider (FARGATE_SPOT is attached too). CPU workers: `capacity: fargate` (README)."
  value       = "FARGATE"
}

output "region" {
  value = local.region
}

# For the coordinator.
output "job_store" {
  description = "The job file's output.dir: the job store bucket, which the coordinator role reads and writes."
  value       = "s3://${aws_s3_bucket.jobs.bucket}/jobs"
}

output "coordinator_task_role_arn" {
  description = "Task role of a coordinator running as an ECS task."
  value       = aws_iam_role.coordinator.arn
}

output "coordinator_policy_json" {
  description = "The coordinator's permissions as a policy document, to attach to the role of a coordinator running elsewhere in the VPC (an EC2 instance profile)."
  value       = data.aws_iam_policy_document.coordinator.json
}

output "submitter_policy_json" {
  description = "What `physalia submit` needs of the submitting user in cluster mode, as a policy document to attach to the user's group or permission set."
  value       = data.aws_iam_policy_document.submitter.json
}

output "coordinator_task_definition" {
  description = "ARN of the coordinator's Fargate task definition (null without coordinator_image)."
  value       = var.coordinator_image == null ? null : aws_ecs_task_definition.coordinator[0].arn
}
