# The aci backend's configuration (AciConfig::new(subscription_id, resource_group, location, subnet_id)).
output "subscription_id" {
  value = data.azurerm_subscription.current.subscription_id
}

output "resource_group" {
  value = azurerm_resource_group.physalia.name
}

output "location" {
  value = azurerm_resource_group.physalia.location
}

output "subnet_id" {
  value = azurerm_subnet.workers.id
}

output "coordinator_identity_id" {
  description = "AciConfig.coordinator_identity_id: the user-assigned identity cluster mode's coordinator group runs as."
  value       = azurerm_user_assigned_identity.coordinator.id
}

output "coordinator_identity_client_id" {
  description = "The coordinator identity's client id (the coordinator picks its identity by resource id, AZURE_MSI_RESOURCE_ID, which submit sets)."
  value       = azurerm_user_assigned_identity.coordinator.client_id
}

output "pull_identity_id" {
  description = "AciConfig.registry.identity_id (null without a registry)."
  value       = var.registry_id == null ? null : azurerm_user_assigned_identity.pull[0].id
}

output "storage_account" {
  description = "AZURE_STORAGE_ACCOUNT_NAME for the job store (output.dir: az://jobs/PREFIX)."
  value       = azurerm_storage_account.jobs.name
}

output "storage_account_id" {
  description = "Scope for the submitting user's Storage Blob Data Contributor role."
  value       = azurerm_storage_account.jobs.id
}
